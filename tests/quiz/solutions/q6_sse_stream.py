"""练习 q6 的参考实现：线路上的一个流式聊天补全。

约定：`stream_chat(outputs, send, model)` 通过 ASGI 的 `send` 回答一个 `stream: true`
的请求，一个选择：
- 先等第一个输出，之前什么都不发。如果那个输出是错误，回答就是普通的 JSON 错误：
  状态码和响应体来自 `to_http(error, "messages")`；
- 否则是一个 200，带 `content-type: text/event-stream`，然后每个输出一条
  `http.response.body`。每个事件都是 `data: <json>` 加一个空行；每个数据块都是
  `chat.completion.chunk`，共用一个 `chatcmpl-` id。第一个数据块的 delta 带角色
  "assistant"（有第一段文本的话也一起带上）；之后的 delta 只带 content；
- 终止输出的那次 send 还带着一个 delta 为空、带 finish_reason 的数据块，然后是
  `data: [DONE]`，并且 `more_body: False`；
- 第一个字节之后的错误是一个 `data: {"error": ...}` 事件（内容和 JSON 错误的响应体
  相同），然后是 `data: [DONE]`，没有带 finish_reason 的数据块。
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

# --8<-- [start:stream_chat]
DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_chat(outputs: AsyncIterator[Output], send: Send, model: str) -> None:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",  # 这个响应的所有数据块共用一个 id
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, str], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return event({**head, "choices": [choice]})

    out = await anext(outputs)
    if out.error is not None:  # 还一个字节都没发：可以用真实的 HTTP 状态码
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
        if out.error is not None:  # 第一个字节之后，错误只能是一个事件
            body += event(to_http(out.error, "messages").body())
        elif out.finish_reason is not None:
            body += chunk({}, out.finish_reason)
        if out.finished:
            body += DONE
        await send({"type": "http.response.body", "body": body, "more_body": not out.finished})
        if out.finished:
            return
        out = await anext(outputs)


# --8<-- [end:stream_chat]
