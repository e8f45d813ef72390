"""Fingerprints computed as the Go client computes them, so that a Go
producer and a Python consumer (or a Go and a Python caller of one
operation) agree on a key's parameters."""

from __future__ import annotations

import hashlib
import struct

from google.protobuf.message import Message


def default_fingerprint(full_method: str, request: Message) -> bytes:
    """The Go client's ``DefaultFingerprint``: SHA-256 of the full method
    name, length-prefixed (8 bytes, big-endian), and the deterministic
    protobuf encoding of the request (map entries in key order).

    Deterministic encoding is stable for one message definition; it is not
    canonical across schema changes (an unknown field, or a field added on
    one side only, changes it).
    """
    method = full_method.encode()
    h = hashlib.sha256()
    h.update(struct.pack(">Q", len(method)))
    h.update(method)
    h.update(request.SerializeToString(deterministic=True))
    return h.digest()
