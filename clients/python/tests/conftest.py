"""A real ``idemreg serve`` for the tests: the binary built from this
checkout (or IDEMREG_BIN) on a free loopback port, on the embedded store in
a temporary directory and, where PostgreSQL runs, on a fresh database of
it (IDEMREG_TEST_DATABASE_URL, or the local server .ci/ensure-postgres
starts). Under CI a PostgreSQL that does not answer fails the run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import idemreg

REPO = Path(__file__).resolve().parents[3]
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"


@pytest.fixture(scope="session")
def binary(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.environ.get("IDEMREG_BIN"):
        return os.environ["IDEMREG_BIN"]
    out = tmp_path_factory.mktemp("bin") / "idemreg"
    subprocess.run(["go", "build", "-o", str(out), "./cmd/idemreg"], cwd=REPO, check=True)
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """One serve; ``client()`` is a new client of it (another process, as
    far as the registry can tell)."""

    def __init__(self, binary: str, store_args: list[str], extra: list[str], **client_kw: object) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("IDEMREG_")}
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", self.target, "--min-lease", "100ms", "--log-level", "error", *store_args, *extra],
            env=env,
        )
        try:
            self._wait_ready(client_kw)
        except BaseException:
            self.stop()  # a serve that never answered is not left running
            raise

    def _wait_ready(self, client_kw: dict[str, object]) -> None:
        # Wait for the port before the first gRPC call: a channel refused
        # while serve starts backs off reconnecting (1 s, growing), and the
        # process-wide subchannel pool would hand that backoff to every
        # client the tests then make for the same target.
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("idemreg serve exited before it listened")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        probe = idemreg.Client(self.target, timeout=1.0, **client_kw)  # type: ignore[arg-type]
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError("idemreg serve exited before it answered")
                try:
                    probe.lookup(idemreg.Key("ready", "probe"))
                    break
                except (idemreg.UnavailableError, idemreg.DeadlineExceededError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
                except idemreg.IdemregError:  # it answers: NOT_FOUND, UNAUTHENTICATED, ...
                    break
        finally:
            probe.close()

    def client(self, **kw: object) -> idemreg.Client:
        return idemreg.Client(self.target, **kw)  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> idemreg.AsyncClient:
        return idemreg.AsyncClient(self.target, **kw)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _psql(url: str, sql: str) -> None:
    subprocess.run(["psql", url, "-v", "ON_ERROR_STOP=1", "-qc", sql], check=True, capture_output=True)


def _postgres_up(url: str) -> bool:
    if shutil.which("psql") is None:
        return False
    try:
        _psql(url, "select 1")
        return True
    except subprocess.CalledProcessError:
        return False


@pytest.fixture(scope="session", params=["embedded", "postgres"])
def registry(request: pytest.FixtureRequest, binary: str) -> Iterator[Registry]:
    """The registry on each store; the suite runs once per store."""
    if request.param == "embedded":
        data = tempfile.mkdtemp(prefix="idemreg-py-data-")
        reg = Registry(binary, ["--data-dir", data], [])
        yield reg
        reg.stop()
        shutil.rmtree(data, ignore_errors=True)
        return
    server = os.environ.get("IDEMREG_TEST_DATABASE_URL", DEFAULT_DB)
    if not _postgres_up(server):
        if os.environ.get("CI"):
            pytest.fail(f"CI: PostgreSQL does not answer at {server} (.ci/ensure-postgres starts it)")
        pytest.skip("PostgreSQL does not answer (psql, IDEMREG_TEST_DATABASE_URL)")
    name = "idemreg_py_" + uuid.uuid4().hex[:12]
    _psql(server, f"create database {name}")
    u = urllib.parse.urlsplit(server)
    db = urllib.parse.urlunsplit((u.scheme, u.netloc, "/" + name, u.query, u.fragment))
    try:
        subprocess.run([binary, "migrate", "--database-url", db], check=True, capture_output=True)
        reg = Registry(binary, ["--database-url", db], [])
        yield reg
        reg.stop()
    finally:
        _psql(server, f"drop database if exists {name} with (force)")


def unique(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
