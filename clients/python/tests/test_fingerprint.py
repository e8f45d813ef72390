"""default_fingerprint agrees with the Go client's DefaultFingerprint on the
shared vectors (client/testdata/fingerprints.json, checked by the Go
client's TestFingerprintVectors)."""

from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2, symbol_database  # noqa: F401 (registers Struct)

import idemreg
from conftest import REPO
from idemreg.v1 import registry_pb2  # noqa: F401 (registers the API's messages)

VECTORS = json.loads((REPO / "client" / "testdata" / "fingerprints.json").read_text())


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_default_fingerprint_matches_go(v: dict[str, str]) -> None:
    cls = symbol_database.Default().GetSymbol(v["type"])
    msg = cls.FromString(bytes.fromhex(v["message_hex"]))
    assert idemreg.default_fingerprint(v["method"], msg).hex() == v["fingerprint_hex"]


def test_vectors_cover_maps() -> None:
    # Map order is where encodings differ: the file must exercise it.
    assert any(v["type"] == "google.protobuf.Struct" and len(v["message_hex"]) > 40 for v in VECTORS)
