"""Messages round-trip through the msgpack codec; anything else is refused."""

from __future__ import annotations

import msgspec
import pytest

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    BackendErrorMsg,
    BackendMsg,
    Codec,
    DetokenizeMsg,
    ErrorInfo,
    ErrorKind,
    TokenizerMsg,
    UserMsg,
    pack_ids,
    unpack_ids,
)


def test_backend_messages_round_trip() -> None:
    codec = Codec(BackendMsg)
    params = SamplingParams(
        temperature=0.7, top_p=0.9, max_tokens=5, seed=2**40, stop_token_ids=[3]
    )
    msgs = [UserMsg.make(1, [0, 5, 2**31 - 1], params), AbortBackendMsg(2)]
    decoded = codec.decode(codec.encode(msgs))
    assert decoded == msgs
    assert decoded[0].input_ids == [0, 5, 2**31 - 1]
    assert decoded[0].sampling_params == params


def test_token_ids_travel_as_four_bytes_each() -> None:
    ids = list(range(1000, 1100))
    assert len(pack_ids(ids)) == 4 * len(ids)
    assert unpack_ids(pack_ids(ids)) == ids


def test_a_message_of_another_channel_is_refused() -> None:
    msgs = [DetokenizeMsg(1, 2, "stop"), BackendErrorMsg(3, ErrorInfo(ErrorKind.INTERNAL, "bad"))]
    data = Codec(TokenizerMsg).encode(msgs)
    assert Codec(TokenizerMsg).decode(data) == msgs
    with pytest.raises(msgspec.ValidationError):
        Codec(BackendMsg).decode(data)
