"""错误设计（测验第 6 题）：200 和 SSE 响应头在第一个输出之前就发出。

就像一个立刻返回流式响应的路由那样：在第一个 token 之前就已知道的错误（比如 prompt
太长），这时只能是 200 流里的一个事件。
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


def _event(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def stream_chat(outputs: AsyncIterator[Output], send: Send, model: str) -> None:
    headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    chunk_id, created, first = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), True
    async for out in outputs:
        body = b""
        if out.error is not None:
            body += _event(to_http(out.error, "messages").body())
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            first = False
            if out.text:
                delta["content"] = out.text
            chunk = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [{"index": 0, "delta": delta,
                                                  "finish_reason": None}]}  # fmt: skip
            body += _event(chunk)
            if out.finished:
                chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
                body += _event(chunk)
        if out.finished:
            body += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": not out.finished})
        if out.finished:
            return
