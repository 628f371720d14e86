"""Quiz question 6: the anatomy of the SSE stream, and errors before and after its first byte.

Checks `stream_chat(outputs, send, model)` (exercise q6), fed with Outputs taken from a
real ReplyBuffer and recording every ASGI message it sends:
- nothing is sent before the first output is in;
- a successful stream is a 200 `text/event-stream` of `data:` events whose chunks validate
  as the `openai` client's ChatCompletionChunk, share one `chatcmpl-` id, start with the
  role "assistant" together with the first text, carry only new text after that, and end
  with an empty delta holding the finish_reason, then `data: [DONE]`;
- one send per output; the last holds the end and `[DONE]` and closes the response;
- a first output that is an error is a plain JSON error with a real status (400, 503...),
  the body of minisgl's `to_http` for the chat endpoint, and no event at all;
- an error after the first byte is one `data: {"error": ...}` event and `data: [DONE]`,
  with no finish_reason chunk.

About minisgl itself, through the real app: one write per wake-up, with `[DONE]` in the
last one, and `stream_options.include_usage` adds a usage chunk just before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk
from quiz_helpers import MODEL, app_client, chat_body

from minisgl.message import ErrorInfo, ErrorKind, UserReply
from minisgl.server.buffer import Output, ReplyBuffer
from minisgl.server.errors import to_http
from minisgl.testing.fakes import make_frontend, settle, wait_until
from minisgl.testing.sse import sse_payloads

pytestmark = pytest.mark.q6

PIECES = ["KV", " Cache", " 是一种缓存"]
LAST = "。"  # the terminal reply carries text too
TOO_LONG = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the prompt is longer than the context")
GONE = ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, "the scheduler process died")


def text(i: int, piece: str) -> UserReply:
    return UserReply(0, piece, prompt_tokens=5, completion_tokens=i + 1)


def the_end(piece: str = LAST, error: ErrorInfo | None = None, uid: int = 0) -> UserReply:
    reason = None if error else "stop"
    n = len(PIECES) + 1
    return UserReply(uid, piece, True, reason, error, prompt_tokens=5, completion_tokens=n)


STREAM = [[text(i, p)] for i, p in enumerate(PIECES)] + [[the_end()]]  # one reply per wake-up


async def outputs_of(
    batches: Sequence[Sequence[UserReply]], gate: asyncio.Event | None = None
) -> AsyncIterator[Output]:
    """What the consumer loop would yield: the buffer taken after each batch of replies;
    with a `gate`, the first output only comes once the gate opens."""
    buffer = ReplyBuffer()
    if gate is not None:
        await gate.wait()
    for batch in batches:
        for reply in batch:
            buffer.append(reply)
        yield buffer.take()


class Wire:
    """The ASGI `send` of one response: every message it was given, in order."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def start(self) -> dict[str, Any]:
        assert self.messages and self.messages[0]["type"] == "http.response.start"
        return self.messages[0]

    def header(self, name: bytes) -> bytes:
        return dict(self.start.get("headers", []))[name]

    @property
    def bodies(self) -> list[dict[str, Any]]:
        bodies = self.messages[1:]
        assert bodies and all(m["type"] == "http.response.body" for m in bodies)
        assert not bodies[-1].get("more_body", False), "响应始终没有结束"
        return bodies

    @property
    def raw(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.bodies)


async def stream(exercise, batches: Sequence[Sequence[UserReply]]) -> Wire:
    wire = Wire()
    await asyncio.wait_for(exercise.stream_chat(outputs_of(batches), wire.send, MODEL), 2.0)
    return wire


# ---------------------------------------------------------------- exercise q6


async def test_nothing_is_sent_before_the_first_output(exercise):
    wire, gate = Wire(), asyncio.Event()
    task = asyncio.create_task(exercise.stream_chat(outputs_of(STREAM, gate), wire.send, MODEL))
    await settle()
    if task.done():
        task.result()  # its error, if it raised one
    assert wire.messages == [], "在第一个输出之前就发了消息：这样错误就没法再有自己的状态码"
    gate.set()
    await asyncio.wait_for(task, 2.0)
    assert wire.start["status"] == 200, "顺利开始的流是 200"


async def test_role_text_finish_reason_and_done_in_order(exercise):
    wire = await stream(exercise, STREAM)
    assert wire.start["status"] == 200, "顺利开始的流是 200"
    assert wire.header(b"content-type").startswith(b"text/event-stream"), (
        "SSE 流以 text/event-stream 发送"
    )
    payloads = sse_payloads(wire.raw)  # every event: "data: " + payload + blank line
    assert payloads[-1] == "[DONE]", "流必须以 data: [DONE] 结束"
    chunks = [ChatCompletionChunk.model_validate(json.loads(p)) for p in payloads[:-1]]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-"), (
        "同一条流的每个数据块都带着同一个 chatcmpl-… id"
    )
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks), (
        "每个数据块都是写明模型名的 chat.completion.chunk"
    )

    deltas = [c.choices[0].delta for c in chunks]
    reasons = [c.choices[0].finish_reason for c in chunks]
    # the first chunk: the role, together with the first text
    assert deltas[0].role == "assistant" and deltas[0].content == PIECES[0], (
        "第一个数据块带着角色 assistant，连同第一段文本"
    )
    # then the text increments, content only
    assert [d.content for d in deltas[1:-1]] == [*PIECES[1:], LAST], (
        "第一个数据块之后，每个数据块只带它那个输出的新文本"
    )
    assert all(d.role is None for d in deltas[1:]), "只有第一个数据块带角色"
    # then an empty delta with the finish reason, the only one that has one
    assert deltas[-1].content is None and deltas[-1].role is None, (
        "finish_reason 单独放在一个 delta 为空的数据块里"
    )
    assert reasons == [None] * (len(chunks) - 1) + ["stop"], (
        f"只有最后一个数据块带 finish_reason：{reasons}"
    )


async def test_one_send_per_output_and_the_end_goes_out_in_the_last(exercise):
    merged = [[text(0, PIECES[0]), text(1, PIECES[1])], [text(2, PIECES[2]), the_end()]]
    wire = await stream(exercise, merged)  # two wake-ups, two replies each
    bodies = wire.bodies
    assert len(bodies) == 2, f"两个输出，所以响应体要发两次；实际发了 {len(bodies)} 次"
    first, last = bodies
    assert first.get("more_body") is True, "第一次发送之后，响应必须保持打开"
    (payload,) = sse_payloads(first["body"])
    assert json.loads(payload)["choices"][0]["delta"]["content"] == "".join(PIECES[:2]), (
        "一个输出含两条回复：一个数据块，带着两段文本"
    )
    new_text, finish, done = sse_payloads(last["body"])
    assert json.loads(new_text)["choices"][0]["delta"] == {"content": PIECES[2] + LAST}
    assert json.loads(finish)["choices"][0]["finish_reason"] == "stop", "没有结束数据块"
    assert done == "[DONE]", "最后一次发送包含结尾：文本、结束数据块、[DONE]"


@pytest.mark.parametrize("error", [TOO_LONG, GONE], ids=["prompt_too_long", "backend_gone"])
async def test_an_error_before_the_first_byte_is_a_real_status_and_a_json_body(exercise, error):
    wire = await stream(exercise, [[the_end("", error)]])
    answer = to_http(error, "messages")
    assert wire.start["status"] == answer.status != 200, (
        f"错误发生在第一个字节之前：应该是它真实的状态码 {answer.status}，而不是 "
        f"{wire.start['status']}（先等到第一个输出，再发响应头）"
    )
    assert wire.header(b"content-type").startswith(b"application/json"), (
        "第一个字节之前的错误是一个普通的 JSON 错误体"
    )
    assert b"data:" not in wire.raw, "流开始之前的错误不是事件"
    assert json.loads(wire.raw) == answer.body(), "不是 to_http 给出的 OpenAI 错误体"


async def test_an_error_after_the_first_byte_is_an_error_event_then_done(exercise):
    wire = await stream(exercise, [[text(0, PIECES[0])], [the_end("", GONE)]])
    assert wire.start["status"] == 200  # already sent: the status cannot change
    payloads = sse_payloads(wire.raw)
    assert payloads[-1] == "[DONE]", "错误事件之后，流照样以 [DONE] 结束"
    assert json.loads(payloads[-2]) == to_http(GONE, "messages").body(), (
        '第一个字节之后的错误是一个 data: {"error": ...} 事件，紧挨在 [DONE] 之前'
    )
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == [PIECES[0]], (
        "只有错误之前的文本作为数据块发出"
    )
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks), (
        "请求不是结束了，而是失败了"
    )


# ---------------------------------------------------------------- minisgl's StreamResponse


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
        backend.inject(the_end(uid=uid))

    tasks = []  # keep a reference: the loop holds tasks only weakly
    backend.on_tokenize = lambda msg: tasks.append(asyncio.ensure_future(play(msg.uid)))


async def minisgl_stream(**extra) -> tuple[bytes, list[bytes]]:
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


async def test_minisgl_one_write_per_wakeup_and_done_goes_out_with_the_last_chunks():
    _, writes = await minisgl_stream()
    assert len(writes) == len(PIECES) + 1
    first = sse_payloads(writes[0])
    assert len(first) == 1 and '"role":"assistant"' in first[0]  # headers + role + "KV"
    for write, piece in zip(writes[1:-1], PIECES[1:]):
        (payload,) = sse_payloads(write)
        assert json.loads(payload)["choices"][0]["delta"] == {"content": piece}
    new_text, finish, done = sse_payloads(writes[-1])  # the terminal wake-up: one write
    assert json.loads(new_text)["choices"][0]["delta"] == {"content": LAST}
    assert json.loads(finish)["choices"][0]["finish_reason"] == "stop"
    assert done == "[DONE]"


async def test_minisgl_include_usage_adds_a_usage_chunk_just_before_done():
    raw, _ = await minisgl_stream(stream_options={"include_usage": True})
    *rest, usage, done = sse_payloads(raw)
    assert done == "[DONE]"
    chunk = ChatCompletionChunk.model_validate(json.loads(usage))
    assert chunk.choices == [] and chunk.usage is not None
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (5, len(PIECES) + 1)
    assert json.loads(rest[-1])["choices"][0]["finish_reason"] == "stop"
