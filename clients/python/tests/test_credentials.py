"""Bearer tokens and TLS against a serve whose config names an identity."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import idemreg
from conftest import Registry, unique

TOKEN = "idemreg_" + secrets.token_urlsafe(32)


def _config(dir: Path) -> Path:
    cfg = dir / "config.yaml"
    cfg.write_text(
        "identities:\n"
        "  - name: py\n"
        f"    token_hashes: [\"sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()}\"]\n"
        "    consumers: [\"py.*\"]\n"
    )
    return cfg


@pytest.fixture(scope="module")
def tls_registry(binary: str) -> Iterator[tuple[Registry, bytes]]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    d = Path(tempfile.mkdtemp(prefix="idemreg-py-tls-"))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", "/CN=idemreg-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True,
    )
    ca = (d / "cert.pem").read_bytes()
    reg = Registry(
        binary,
        ["--data-dir", str(d / "data")],
        ["--config", str(_config(d)), "--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem")],
        root_certificates=ca,
    )
    yield reg, ca
    reg.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_a_token_over_tls(tls_registry: tuple[Registry, bytes]) -> None:
    reg, ca = tls_registry
    with reg.client(root_certificates=ca, token=TOKEN) as c:
        res = c.once("py.auth", unique(), lambda a: "ok")
        assert res.ran and res.value == "ok"
        with pytest.raises(idemreg.PermissionDeniedError):
            c.once("other.team", unique(), lambda a: "no")
    with reg.client(root_certificates=ca) as anonymous:
        with pytest.raises(idemreg.UnauthenticatedError):
            anonymous.lookup(idemreg.Key("py.auth", unique()))
    with reg.client(root_certificates=ca, token="idemreg_wrong") as wrong:
        with pytest.raises(idemreg.UnauthenticatedError):
            wrong.lookup(idemreg.Key("py.auth", unique()))


def test_an_insecure_token_over_plaintext(binary: str) -> None:
    d = Path(tempfile.mkdtemp(prefix="idemreg-py-plain-"))
    reg = Registry(binary, ["--data-dir", str(d / "data")], ["--config", str(_config(d))])
    try:
        with reg.client(token=TOKEN, insecure_token=True) as c:
            assert c.once("py.auth", unique(), lambda a: 1).ran
    finally:
        reg.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_token_is_refused_over_plaintext_unless_allowed() -> None:
    with pytest.raises(ValueError, match="plaintext"):
        idemreg.Client("127.0.0.1:1", token=TOKEN)


@pytest.mark.parametrize("bad", ["", TOKEN + "\n", "with space", "nön-ascii"])
def test_a_malformed_token_is_refused_unsent_and_unquoted(bad: str) -> None:
    kw: dict[str, Any] = {"token": bad, "insecure_token": True}
    with pytest.raises(idemreg.UnauthenticatedError) as e:
        idemreg.Client("127.0.0.1:1", **kw)
    if bad:
        assert bad.strip() not in str(e.value)
    with pytest.raises(idemreg.UnauthenticatedError):
        idemreg.bearer_token(bad)
