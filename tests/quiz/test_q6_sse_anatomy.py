"""Q6：对照 stream_chat_completions，找出角色、增量文本、结束原因和 [DONE] 的发送位置。

答（minisgl：`response.StreamResponse.serve` 每次唤醒发一次，`formats.ChatFormat.chunks` 决定
这一次里有哪些事件）：
- 角色：每个 choice 的第一个数据块的 delta 带 `role: "assistant"`，而且和第一段文本在同一个块里，
  不要假定它们分两次发送；
- 增量文本：之后每次唤醒取到的新文本是一个块，delta 里只有 `content`；
- 结束原因：结束的那次输出后面跟一个 delta 为空、带 `finish_reason` 的块；
- `[DONE]`：和最后的块在同一次写出里，紧跟其后；它是 OpenAI 接口的约定，不是 SSE 标准的一部分。
每个事件是一行 `data: <json>` 加一个空行；每个 JSON 都能被官方 `openai` 客户端的
`ChatCompletionChunk` 解析。

做法：真实的 FastAPI 应用加假的后端；用一层 ASGI 包装记下每次 `http.response.body` 写出的字节，
后端每次等上一块写出后才送下一条回复，于是"一次唤醒 = 一次写出"是确定的。
"""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletionChunk
from quiz_helpers import MODEL, app_client, chat_body, sse_payloads

from minisgl.message import UserReply
from minisgl.testing.fakes import make_frontend, wait_until

pytestmark = pytest.mark.q6

PIECES = ["KV", " Cache", " 是一种缓存"]
LAST = "。"  # the terminal reply carries text too


class RecordWrites:
    """ASGI wrapper: the body bytes of every write the response makes, in order."""

    def __init__(self, app) -> None:
        self.app, self.writes = app, []

    async def __call__(self, scope, receive, send):
        async def recording_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                self.writes.append(message["body"])
            await send(message)

        await self.app(scope, receive, recording_send)


def answer_step_by_step(backend, recorder: RecordWrites) -> None:
    """One reply per write: the next reply is sent once the previous output went out."""

    async def play(uid: int) -> None:
        for i, piece in enumerate(PIECES):
            backend.inject(UserReply(uid, piece, prompt_tokens=5, completion_tokens=i + 1))
            await wait_until(lambda i=i: len(recorder.writes) == i + 1)
        n = len(PIECES) + 1
        end = UserReply(uid, LAST, True, "stop", prompt_tokens=5, completion_tokens=n)
        backend.inject(end)

    tasks = []  # keep a reference: the loop holds tasks only weakly
    backend.on_tokenize = lambda msg: tasks.append(asyncio.ensure_future(play(msg.uid)))


async def stream(**extra) -> tuple[bytes, list[bytes]]:
    frontend, backend = make_frontend()
    recorders = []

    def wrap(app):
        recorders.append(RecordWrites(app))
        return recorders[-1]

    async with app_client(frontend, wrap) as client:
        answer_step_by_step(backend, recorders[0])
        resp = await client.post("/v1/chat/completions", json=chat_body(True, **extra))
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        await wait_until(lambda: frontend.states == {})
    assert backend.aborts() == []  # the request ended normally
    return resp.content, recorders[0].writes


async def test_role_text_finish_reason_and_done_in_order():
    raw, _ = await stream()
    payloads = sse_payloads(raw)  # every event: "data: " + payload + blank line
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)

    deltas = [c.choices[0].delta for c in chunks]
    reasons = [c.choices[0].finish_reason for c in chunks]
    # the first chunk: the role, together with the first text
    assert deltas[0].role == "assistant" and deltas[0].content == "KV"
    # then the text increments, content only
    assert [d.content for d in deltas[1:-1]] == [*PIECES[1:], LAST]
    assert all(d.role is None for d in deltas[1:])
    # then an empty delta with the finish reason, the only one that has one
    assert deltas[-1].content is None and deltas[-1].role is None
    assert reasons == [None] * (len(chunks) - 1) + ["stop"]


async def test_one_write_per_wakeup_and_done_goes_out_with_the_last_chunks():
    _, writes = await stream()
    assert len(writes) == len(PIECES) + 1
    first = sse_payloads(writes[0])
    assert len(first) == 1 and '"role":"assistant"' in first[0]  # headers + role + "KV"
    for write, piece in zip(writes[1:-1], PIECES[1:]):
        (payload,) = sse_payloads(write)
        assert json.loads(payload)["choices"][0]["delta"] == {"content": piece}
    text, finish, done = sse_payloads(writes[-1])  # the terminal wake-up: one write, 3 events
    assert json.loads(text)["choices"][0]["delta"] == {"content": LAST}
    assert json.loads(finish)["choices"][0]["finish_reason"] == "stop"
    assert done == "[DONE]"


async def test_include_usage_adds_a_usage_chunk_just_before_done():
    raw, _ = await stream(stream_options={"include_usage": True})
    *rest, usage, done = sse_payloads(raw)
    assert done == "[DONE]"
    chunk = ChatCompletionChunk.model_validate(json.loads(usage))
    assert chunk.choices == [] and chunk.usage is not None
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (5, len(PIECES) + 1)
    assert json.loads(rest[-1])["choices"][0]["finish_reason"] == "stop"
