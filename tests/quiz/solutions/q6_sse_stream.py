"""Reference solution of exercise q6: one streamed chat completion on the wire.

Contract: `stream_chat(outputs, send, model)` answers one request with `stream: true`
through the ASGI `send`, one choice:
- it waits for the first output before it sends anything. If that output is an error,
  the answer is a plain JSON error: the status and body of `to_http(error, "messages")`;
- otherwise a 200 with `content-type: text/event-stream`, then one `http.response.body`
  per output. Every event is `data: <json>` and a blank line; every chunk is a
  `chat.completion.chunk` with one `chatcmpl-` id. The first chunk's delta carries role
  "assistant" (with the first text, if any); later deltas carry content only;
- the terminal output's send also holds a chunk with an empty delta and the finish_reason,
  then `data: [DONE]`, and has `more_body: False`;
- an error after the first byte is one `data: {"error": ...}` event (the same body as a
  JSON error), then `data: [DONE]`, and no finish_reason chunk.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from minisgl.server.buffer import Output
from minisgl.server.errors import to_http

Send = Callable[[dict[str, Any]], Awaitable[None]]

DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_chat(outputs: AsyncIterator[Output], send: Send, model: str) -> None:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",  # one id for every chunk of the response
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, str], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return event({**head, "choices": [choice]})

    out = await anext(outputs)
    if out.error is not None:  # not a byte sent yet: a real HTTP status
        answer = to_http(out.error, "messages")
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer.body()).encode()})
        return
    headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    first = True
    while True:
        delta = {"role": "assistant"} if first else {}
        first = False
        if out.text:
            delta["content"] = out.text
        body = chunk(delta, None) if delta else b""
        if out.error is not None:  # after the first byte an error can only be an event
            body += event(to_http(out.error, "messages").body())
        elif out.finish_reason is not None:
            body += chunk({}, out.finish_reason)
        if out.finished:
            body += DONE
        await send({"type": "http.response.body", "body": body, "more_body": not out.finished})
        if out.finished:
            return
        out = await anext(outputs)
