"""The two ways a completion goes back to the client, as plain ASGI callables.

Contract: a route hands `respond` a `Job` (one message maker per prompt, and the output
format), which picks `StreamResponse` or `FullResponse`. Calling it (Starlette does) runs
the whole request inside `frontend.request(...)` scopes while a second task watches the
ASGI receive channel: a client that disconnects, before or after the first byte, cancels
the serving task, so the scope exits early and sends AbortMsg. An error known before the
first byte is a JSON body with a real HTTP status, also for `stream: true` (the stream
waits for the first output before its headers); after it, the format's error event. Each
send to the client runs inside `frontend.sending(state)`, which the stall sweeper watches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from minisgl.message import ErrorInfo, ErrorKind, TokenInfo, TokenizeMsg

from .errors import RequestFailed, error_code, json_response
from .formats import OutputFormat
from .frontend import FrontendManager
from .memory import logprobs_bytes, text_bytes
from .middleware import request_id_var

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell reverse proxies not to buffer the stream
]


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
    fmt: OutputFormat
    n: int = 1  # choices per prompt
    logprobs: bool = False
    include_usage: bool = False


# --8<-- [start:respond]
def respond(request: Request, req: Any, job: Job) -> Response:
    """The response that serves `job`: streamed or whole, as the request asked."""
    if req.user is not None:
        logger.info("request %s: user %r", request_id_var.get(), req.user)
    return (StreamResponse if req.stream else FullResponse)(request.app.state.frontend, job)


# --8<-- [end:respond]


class _CompletionResponse(Response):
    """A Starlette Response only so that FastAPI passes it through untouched."""

    def __init__(self, frontend: FrontendManager, job: Job) -> None:
        self.frontend, self.job = frontend, job
        self.background = None

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive = scope, receive
        if await serve_until_disconnect(self._serve_or_refuse(send), receive):
            self.frontend.observer.event(None, "disconnected")

    async def _serve_or_refuse(self, send: Send) -> None:
        try:
            await self.serve(send)
        except RequestFailed as refused:  # before the request reached the backend
            code = error_code(refused.error) or "refused"
            self.frontend.observer.event(None, "refused", code=code)
            await self.send_error(send, refused.error)

    async def send_error(self, send: Send, error: ErrorInfo) -> None:
        """An error known before the first byte: a JSON body with a real HTTP status."""
        await self.send_response(send, self.job.fmt.error(error).response())

    async def send_response(self, send: Send, response: Response) -> None:
        await response(self.scope, self.receive, send)

    async def serve(self, send: Send) -> None:
        raise NotImplementedError


# --8<-- [start:full_serve]
class FullResponse(_CompletionResponse):
    """Non-streaming: collect the whole output, then one JSON body."""

    async def serve(self, send: Send) -> None:
        job = self.job
        k = len(job.make_msgs) * job.n  # choices in the response
        texts: list[list[str]] = [[] for _ in range(k)]
        finish: list[str | None] = [None] * k
        logprobs: list[list[TokenInfo]] = [[] for _ in range(k)]
        cap, collected, too_large = self.frontend.max_response_bytes, 0, None
        async with self.frontend.requests(job.make_msgs, job.n) as states:
            async with aclosing(self.frontend.wait_for_ack(*states)) as outputs:
                async for out in outputs:
                    for c in out.choices:
                        texts[c.index].append(c.text)
                        logprobs[c.index] += c.logprobs
                        finish[c.index] = c.finish_reason or finish[c.index]
                        collected += text_bytes(c.text) + logprobs_bytes(c.logprobs)
                    if collected > cap:  # leaving the scope aborts the rest
                        too_large = _too_large(cap)
                        break
            if too_large is not None or out.error is not None:
                await self.send_error(send, too_large or out.error)
                return
            body = job.fmt.body(
                ["".join(t) for t in texts],
                finish,
                logprobs if job.logprobs else None,
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
                out.reasoning_open,
            )
            # a client that never reads this body is a stall too
            with self.frontend.sending(states[0]):
                await self.send_response(send, json_response(200, body))


# --8<-- [end:full_serve]


def _too_large(cap: int) -> ErrorInfo:
    return ErrorInfo(
        ErrorKind.RESPONSE_TOO_LARGE,
        f"the whole response would hold more than {cap} bytes of output "
        "(--max-response-bytes); ask for fewer tokens, choices or logprobs, or stream it",
    )


class StreamResponse(_CompletionResponse):
    """Streaming: SSE chunks as output arrives, headers only once the first output is in."""

    # --8<-- [start:stream_serve]
    async def serve(self, send: Send) -> None:
        job = self.job
        async with self.frontend.requests(job.make_msgs, job.n) as states:
            async with aclosing(self.frontend.wait_for_ack(*states)) as outputs:
                out = await anext(outputs)
                if out.error is not None:  # nothing sent yet: a real HTTP status
                    await self.send_error(send, out.error)
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                while True:
                    body = job.fmt.chunks(out)
                    if out.finished:
                        body += job.fmt.closing(out, job.include_usage)
                    with self.frontend.sending(states[0]):
                        more = not out.finished
                        await send({"type": "http.response.body", "body": body, "more_body": more})
                    if out.finished:
                        return
                    out = await anext(outputs)

    # --8<-- [end:stream_serve]
