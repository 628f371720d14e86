"""Wire helpers shared by every channel (re-exported by `minisgl.message`): a msgpack codec
for a tagged union of Structs, and token ids packed as a compact int32 array.

Contract: `Codec(Union[...])` encodes one message or a list of messages and decodes exactly
the union it was built for; anything else is a `msgspec.ValidationError`. Never pickle.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


def pack_ids(ids: list[int]) -> bytes:
    a = array("i", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


class Codec(Generic[T]):
    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[union])

    def encode(self, msgs: list[T]) -> bytes:
        return self._encoder.encode(msgs)

    def decode(self, data: bytes) -> list[T]:
        return self._decoder.decode(data)
