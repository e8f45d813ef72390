"""Codecs: how ``once`` stores a handler's value and decodes a replay."""

from __future__ import annotations

import json
from typing import Any, Protocol


class Codec(Protocol):
    """Encodes a handler's value to the bytes the registry stores, and back."""

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class JSONCodec:
    """JSON, UTF-8, compact (the default). None is stored as no bytes, and no
    bytes decode as None, so a handler that returns nothing stores nothing."""

    def encode(self, value: Any) -> bytes:
        if value is None:
            return b""
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def decode(self, data: bytes) -> Any:
        if not data:
            return None
        return json.loads(data)


class BytesCodec:
    """The bytes as they are, as the Go client's Once stores them."""

    def encode(self, value: Any) -> bytes:
        if value is None:
            return b""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"BytesCodec stores bytes, not {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> Any:
        return bytes(data)


JSON = JSONCodec()
BYTES = BytesCodec()
