"""Reading server-sent events the way the tests, the notebooks and the benchmarks check them:
one parser, strict about the framing minisgl sends.

Contract:
- `parse_events(body, named=False)` splits a complete SSE body (bytes or text) into its
  events. Every event is one `data: ` line and a blank line; with `named=True` (the
  Responses API) an `event: ` line comes first. Anything else, or a body that does not end
  with a blank line, raises `SSEFormatError` (an AssertionError, so pytest shows it as a
  failed check) quoting the offending part. An empty body has no events.
- `sse_payloads(body)` is the `data` of each event; `sse_chunks(body)` the JSON chunks of a
  finished chat or completions stream: `[DONE]` must come exactly once, last, and is not
  among them.
- `iter_payloads(lines)` / `aiter_payloads(lines)` read the payloads of a stream being
  received, line by line (httpx's `iter_lines` / `aiter_lines`), so a caller can stop
  mid-stream; they yield `[DONE]` too. Strict, they refuse a line that is neither a `data: `
  line nor the blank line after one; `strict=False` (a load generator pointed at another
  server) skips comments and other fields. `chunks_of_lines(lines)` is `sse_chunks` over
  lines.
- `response_events(body)`: a finished Responses API stream as the official client's typed
  events (openai's `ResponseStreamEvent`, validated strictly), each event's `event:` name
  its type and the sequence numbers 0, 1, 2, ... (AssertionError otherwise).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"  # the payload that ends a chat or completions stream
_DATA, _EVENT = "data: ", "event: "


class SSEFormatError(AssertionError):
    """The bytes are not the SSE framing they should be."""


@dataclass(frozen=True)
class Event:
    data: str
    name: str | None = None  # the `event:` field, in a named stream


def _text(body: bytes | str) -> str:
    return body.decode() if isinstance(body, bytes) else body


def parse_events(body: bytes | str, named: bool = False) -> list[Event]:
    text = _text(body)
    if not text:
        return []
    if not text.endswith("\n\n"):
        raise SSEFormatError(f"an SSE body ends with a blank line: ...{text[-200:]!r}")
    events = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        name = None
        if named:
            if len(lines) != 2 or not lines[0].startswith(_EVENT):
                raise SSEFormatError(f"not an `event:` line then a `data:` line: {block[:200]!r}")
            name = lines.pop(0)[len(_EVENT) :]
        if len(lines) != 1 or not lines[0].startswith(_DATA):
            raise SSEFormatError(f"not one `data: ` line: {block[:200]!r}")
        events.append(Event(lines[0][len(_DATA) :], name))
    return events


def sse_payloads(body: bytes | str) -> list[str]:
    return [event.data for event in parse_events(body)]


def _chunks(payloads: list[str]) -> list[dict[str, Any]]:
    if not payloads or payloads[-1] != DONE:
        raise SSEFormatError(f"the stream does not end with data: {DONE}: {payloads[-3:]}")
    if DONE in payloads[:-1]:
        raise SSEFormatError(f"data: {DONE} comes more than once")
    return [json.loads(p) for p in payloads[:-1]]


def sse_chunks(body: bytes | str) -> list[dict[str, Any]]:
    return _chunks(sse_payloads(body))


class _LineReader:
    """One line of a stream at a time: the payload it completes, or None."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.after_data = False  # the last line was a data line: a blank one must follow

    def feed(self, line: str) -> str | None:
        if line == "":
            self.after_data = False
            return None
        if line.startswith(_DATA):
            if self.strict and self.after_data:
                raise SSEFormatError(f"a second data line in one event: {line[:200]!r}")
            self.after_data = True
            return line[len(_DATA) :]
        if self.strict:
            raise SSEFormatError(f"not a `data: ` line: {line[:200]!r}")
        return None  # a comment, or a field minisgl does not send


def iter_payloads(lines: Iterable[str], strict: bool = True) -> Iterator[str]:
    reader = _LineReader(strict)
    for line in lines:
        if (payload := reader.feed(line)) is not None:
            yield payload


async def aiter_payloads(lines: AsyncIterable[str], strict: bool = True) -> AsyncIterator[str]:
    reader = _LineReader(strict)
    async for line in lines:
        if (payload := reader.feed(line)) is not None:
            yield payload


def chunks_of_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    return _chunks(list(iter_payloads(lines)))


@functools.cache
def _response_event_adapter():
    from openai.types.responses import ResponseStreamEvent  # the tests' client, not a server need
    from pydantic import TypeAdapter

    return TypeAdapter(ResponseStreamEvent)


def response_events(body: bytes | str) -> list:
    adapter, events = _response_event_adapter(), []
    for sse in parse_events(body, named=True):
        event = adapter.validate_python(json.loads(sse.data), strict=True)
        if sse.name != event.type:
            raise SSEFormatError(f"an event named {sse.name!r} holds a {event.type!r}")
        events.append(event)
    numbers = [e.sequence_number for e in events]
    if numbers != list(range(len(events))):
        raise SSEFormatError(f"sequence numbers {numbers}, not 0, 1, 2, ...")
    return events
