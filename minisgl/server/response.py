"""The two ways a completion goes back to the client, as plain ASGI callables.

Contract: a route returns `StreamResponse` or `FullResponse`; calling it (Starlette does)
runs the whole request inside one `frontend.request(...)` scope while a second task listens
on the ASGI receive channel. A client that disconnects (streaming or not, before or after
the first byte) cancels the serving task, so the scope exits early and sends AbortMsg.

- Errors known before the first byte (refused prompt, tokenizer failure, dead backend)
  are a JSON error body with a real HTTP status, also for `stream: true`: the stream waits
  for the first output before it sends its headers.
- An error after streaming began is one `data: {"error": ...}` event, then `data: [DONE]`.
- While a chunk is being sent, `state.sending_since` is set; the stall sweeper cancels a
  request whose send has blocked longer than `--client-stall-timeout` (the client reads
  nothing while output waits). The connection is then closed without a final chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from minisgl.message import ErrorInfo, TokenInfo, TokenizeMsg

from .formats import SSE_DONE, ChatFormat, CompletionFormat, error_body
from .frontend import FrontendManager, Refused

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell reverse proxies not to buffer the stream
]


async def send_json(send: Send, status: int, body: dict[str, Any], headers=()) -> None:
    data = msgspec.json.encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


def unavailable(message: str) -> ErrorInfo:
    return ErrorInfo(message, status=503, code="backend_unavailable", type="server_error")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# --8<-- [start:serve_until_disconnect]
async def serve_until_disconnect(serve: Awaitable[None], receive: Receive) -> bool:
    """Run `serve` until it ends or the client disconnects, whichever comes first;
    return whether the client disconnected first."""
    body = asyncio.ensure_future(serve)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        disconnected = not body.done()
        if disconnected:
            # the client is gone: cancel the body and let its request scope exit
            # (sending AbortMsg) before this response returns
            body.cancel()
            await asyncio.wait({body})
    if not body.cancelled() and body.exception() is not None:
        raise body.exception()
    return disconnected


# --8<-- [end:serve_until_disconnect]


@dataclass
class Job:
    """What a route hands its response: one message maker per prompt, and how to answer."""

    make_msgs: list[Callable[[int], TokenizeMsg]]
    fmt: ChatFormat | CompletionFormat
    n: int = 1  # choices per prompt
    logprobs: bool = False
    include_usage: bool = False


class _CompletionResponse(Response):
    """A Starlette Response only so that FastAPI passes it through untouched."""

    def __init__(self, frontend: FrontendManager, job: Job) -> None:
        self.frontend, self.job = frontend, job
        self.background = None

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        disconnected = await serve_until_disconnect(self._serve_or_refuse(send), receive)
        if disconnected and self.frontend.metrics is not None:
            self.frontend.metrics.on_disconnect()

    async def _serve_or_refuse(self, send: Send) -> None:
        try:
            await self.serve(send)
        except Refused as refused:
            if self.frontend.metrics is not None:
                self.frontend.metrics.on_rejected(refused.error.code or "refused")
            headers = []
            if refused.retry_after is not None:
                headers.append((b"retry-after", str(refused.retry_after).encode()))
            await send_json(send, refused.error.status, error_body(refused.error), headers)

    async def serve(self, send: Send) -> None:
        raise NotImplementedError


class FullResponse(_CompletionResponse):
    """Non-streaming: collect the whole output, then one JSON body."""

    async def serve(self, send: Send) -> None:
        job = self.job
        k = len(job.make_msgs) * job.n  # choices in the response
        texts: list[list[str]] = [[] for _ in range(k)]
        finish: list[str | None] = [None] * k
        logprobs: list[list[TokenInfo]] = [[] for _ in range(k)]
        async with self.frontend.requests(job.make_msgs, job.n) as states:
            async with aclosing(self.frontend.wait_for_ack(*states)) as outputs:
                async for out in outputs:
                    for c in out.choices:
                        texts[c.index].append(c.text)
                        logprobs[c.index] += c.logprobs
                        finish[c.index] = c.finish_reason or finish[c.index]
            if out.error is not None:
                await send_json(send, out.error.status, error_body(out.error))
                return
            body = job.fmt.body(
                ["".join(t) for t in texts],
                finish,
                logprobs if job.logprobs else None,
                out.prompt_tokens,
                out.completion_tokens,
            )
            for state in states:  # a client that never reads this body is a stall too
                state.task = asyncio.current_task()
            states[0].sending_since = asyncio.get_running_loop().time()
            await send_json(send, 200, body)


class StreamResponse(_CompletionResponse):
    """Streaming: SSE chunks as output arrives, headers only once the first output is in."""

    # --8<-- [start:stream_serve]
    async def serve(self, send: Send) -> None:
        loop, job = asyncio.get_running_loop(), self.job
        async with self.frontend.requests(job.make_msgs, job.n) as states:
            for state in states:
                state.task = asyncio.current_task()
            async with aclosing(self.frontend.wait_for_ack(*states)) as outputs:
                out = await anext(outputs)
                if out.error is not None:  # nothing sent yet: a real HTTP status
                    await send_json(send, out.error.status, error_body(out.error))
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                while True:
                    body = job.fmt.chunks(out)
                    if out.finished:
                        if job.include_usage and out.error is None:
                            body += job.fmt.usage_chunk(out)
                        body += SSE_DONE
                    states[0].sending_since = loop.time()
                    await send(
                        {"type": "http.response.body", "body": body, "more_body": not out.finished}
                    )
                    states[0].sending_since = None
                    if out.finished:
                        return
                    out = await anext(outputs)

    # --8<-- [end:stream_serve]
