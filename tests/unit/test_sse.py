"""The one SSE reader of the tests, notebooks and benchmarks (minisgl.testing.sse): what it
accepts is exactly the framing minisgl sends, and anything else is a failed check."""

from __future__ import annotations

import asyncio

import pytest

from minisgl.testing.sse import (
    DONE,
    Event,
    SSEFormatError,
    aiter_payloads,
    chunks_of_lines,
    iter_payloads,
    parse_events,
    sse_chunks,
    sse_payloads,
)

BODY = b'data: {"a":1}\n\ndata: {"\xc3\xa9":2}\n\ndata: [DONE]\n\n'


def test_a_body_splits_into_payloads_and_chunks() -> None:
    assert sse_payloads(BODY) == ['{"a":1}', '{"é":2}', DONE]
    assert sse_payloads(BODY.decode()) == sse_payloads(BODY)
    assert sse_chunks(BODY) == [{"a": 1}, {"é": 2}]
    assert sse_payloads(b"") == []


@pytest.mark.parametrize(
    "body",
    [
        b'data: {"a":1}\n\ndata: [DONE]\n',  # no blank line at the end
        b'data: {"a":1}\ndata: {"b":2}\n\n',  # two data lines in one event
        b"data:[DONE]\n\n",  # no space
        b": a comment\n\ndata: [DONE]\n\n",
        b"event: x\ndata: {}\n\n",  # a named event where none is expected
    ],
)
def test_any_other_framing_is_refused(body: bytes) -> None:
    with pytest.raises(SSEFormatError):
        sse_payloads(body)


@pytest.mark.parametrize(
    "body",
    [
        b'data: {"a":1}\n\n',  # cut before [DONE]
        b"data: [DONE]\n\ndata: {}\n\ndata: [DONE]\n\n",  # [DONE] twice
    ],
)
def test_chunks_need_one_done_at_the_end(body: bytes) -> None:
    with pytest.raises(SSEFormatError, match=r"\[DONE\]"):
        sse_chunks(body)


def test_named_events_carry_their_name() -> None:
    body = "event: response.created\ndata: {}\n\nevent: response.completed\ndata: {}\n\n"
    assert parse_events(body, named=True) == [
        Event("{}", "response.created"),
        Event("{}", "response.completed"),
    ]
    with pytest.raises(SSEFormatError):
        parse_events("data: {}\n\n", named=True)


LINES = ['data: {"a":1}', "", "data: [DONE]", ""]


def test_lines_give_the_same_payloads_lazily() -> None:
    assert list(iter_payloads(LINES)) == ['{"a":1}', DONE]
    assert chunks_of_lines(LINES) == [{"a": 1}]
    payloads = iter_payloads(iter(['data: {"a":1}', "", "not sse"]))
    assert next(payloads) == '{"a":1}'  # read before the bad line is reached
    with pytest.raises(SSEFormatError):
        next(payloads)


def test_strict_lines_refuse_what_lenient_lines_skip() -> None:
    other = [": ping", "", "event: x", 'data: {"a":1}', "", "data: [DONE]", ""]
    with pytest.raises(SSEFormatError):
        list(iter_payloads(other))
    assert list(iter_payloads(other, strict=False)) == ['{"a":1}', DONE]
    with pytest.raises(SSEFormatError, match="second data line"):
        list(iter_payloads(["data: 1", "data: 2", ""]))


def test_async_lines_read_like_sync_ones() -> None:
    async def lines():
        for line in LINES:
            yield line

    async def read() -> list[str]:
        return [p async for p in aiter_payloads(lines())]

    assert asyncio.run(read()) == list(iter_payloads(LINES))
