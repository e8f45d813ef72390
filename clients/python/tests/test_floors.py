"""The floors pyproject.toml states are the versions the tests run on.

.ci/test runs the suite on Debian bookworm's python3, python3-grpcio and
python3-protobuf and sets IDEMREG_PYTHON_FLOORS=exact, so that the floors
are tested rather than stated: raising a floor without the tests' Python
(or lowering one below it) fails here."""

from __future__ import annotations

import os
import re
import sys

import grpc
import google.protobuf

from conftest import REPO

PYPROJECT = (REPO / "clients" / "python" / "pyproject.toml").read_text()


def _floor(pattern: str) -> tuple[int, ...]:
    m = re.search(pattern, PYPROJECT)
    assert m, pattern
    return tuple(int(x) for x in m.group(1).split("."))


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])


def test_the_running_versions_meet_the_floors() -> None:
    python = _floor(r'requires-python = ">=([\d.]+)"')
    grpcio = _floor(r'"grpcio>=([\d.]+)"')
    protobuf = _floor(r'"protobuf>=([\d.]+)"')
    assert sys.version_info[:2] >= python
    assert _version(grpc.__version__) >= grpcio
    assert _version(google.protobuf.__version__) >= protobuf
    if os.environ.get("IDEMREG_PYTHON_FLOORS") == "exact":
        assert sys.version_info[:2] == python, "the tests run on the Python floor"
        assert _version(grpc.__version__) == grpcio, "the tests run on the grpcio floor"
        assert _version(google.protobuf.__version__) == protobuf, "the tests run on the protobuf floor"
