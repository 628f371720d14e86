"""The quiz's capstone: the real three-process server answering with the learner's q3-q7.

Collected only with `--capstone` (`pytest tests/quiz --learner --capstone`; without
--learner, on the reference solutions). One server for the module: `python -m minisgl` on
the tiny random Llama with MINISGL_QUIZ_DIR naming the folder under test, so its API server
runs that folder's q3-q7 in the request path (minisgl/server/quiz_pieces.py says what
replaces what). Each test is one check, marked `capstone(title, files, hint)`: a learner's
run prints, per failing check, its title, what it observed (the failure's first line), the
files likely at fault and the hint (conftest.py). Every check ends with /debug/lifecycle
back at zero in all three processes. The answers are checked against each other: greedy and
past the end-of-sequence token, a prompt's answer is the same streamed or whole, alone or
among others, and has exactly the tokens asked for.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk
from quiz_capstone import MAX_SEQ_LEN, last_error, lifecycle, nonzero

from minisgl.testing.server import RunningServer, is_zero
from minisgl.testing.sse import SSEFormatError, chunks_of_lines, iter_payloads

pytestmark = pytest.mark.timeout(300)  # the server's start on a busy machine included

SHORT = 24  # tokens of an answer checked whole
LONG = 600  # tokens: an answer still in flight when its client leaves
WAIT = 30.0  # seconds an answer may take before the check calls it lost
ZERO_WITHIN = 5.0  # seconds for every component to be back at zero after a check
PROMPTS = ["什么是 KV Cache？", "The capital of France is", "def forward(self, x):"]


@pytest.fixture
def back_at_zero(capstone_server: RunningServer, pieces_dir: Path) -> Callable[[], None]:
    """Call at the end of a check: fails unless every component is back at zero."""
    server = capstone_server
    leftover = not is_zero(lifecycle(server, pieces_dir))

    def check() -> None:
        deadline = time.monotonic() + ZERO_WITHIN
        while not is_zero(state := lifecycle(server, pieces_dir)):
            if time.monotonic() > deadline:
                before = "（这个检查开始之前就不是零：前面的检查留下了状态）" if leftover else ""
                pytest.fail(
                    f"{ZERO_WITHIN:.0f} 秒之后 /debug/lifecycle 还没有回到零：{nonzero(state)}"
                    + before,
                    pytrace=False,
                )
            time.sleep(0.05)

    return check


class Client:
    """The checks' requests to the capstone server, each failure said in a line."""

    def __init__(self, server: RunningServer, pieces: Path) -> None:
        self.server, self.pieces = server, pieces
        self.url = f"{server.base_url}/v1/chat/completions"

    def body(self, prompt: str, max_tokens: int = SHORT, **extra) -> dict:
        return {
            "model": self.server.model_name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # exactly max_tokens tokens: an answer cut short shows
            **extra,
        }

    def refused(self, r: httpx.Response, what: str) -> str:
        if r.status_code >= 500:
            return f"{what}得到 HTTP {r.status_code}。{last_error(self.server.log(), self.pieces)}"
        return f"{what}得到 HTTP {r.status_code}：{r.text[:160]}"

    async def whole(self, http: httpx.AsyncClient, prompt: str) -> str:
        try:
            r = await http.post(self.url, json=self.body(prompt))
        except httpx.TimeoutException:
            pytest.fail(f"非流式请求等了 {WAIT:.0f} 秒也没有回答：回答丢了，或者没有结束", False)
        assert r.status_code == 200, self.refused(r, "非流式请求")
        (choice,) = r.json()["choices"]
        tokens = r.json()["usage"]["completion_tokens"]
        assert choice["finish_reason"] == "length" and tokens == SHORT, (
            f"非流式回答应当有 {SHORT} 个 token、finish_reason 为 length，"
            f"得到 {tokens} 个、{choice['finish_reason']}"
        )
        return choice["message"]["content"]

    async def streamed(self, http: httpx.AsyncClient, prompt: str) -> str:
        """The text of a whole streamed answer, every chunk checked on the way."""
        try:
            async with http.stream("POST", self.url, json=self.body(prompt, stream=True)) as r:
                if r.status_code != 200:
                    await r.aread()
                    pytest.fail(self.refused(r, "流式请求"), False)
                kind = r.headers["content-type"]
                assert kind.startswith("text/event-stream"), f"流式回答的 content-type 是 {kind}"
                lines = [line async for line in r.aiter_lines()]
        except httpx.TimeoutException:
            pytest.fail(f"流式请求等了 {WAIT:.0f} 秒也没有结束：有输出没送到，或者没有结束", False)
        try:
            chunks = [ChatCompletionChunk.model_validate(c) for c in chunks_of_lines(lines)]
        except (SSEFormatError, ValueError) as exc:
            pytest.fail(f"流式回答的格式不对：{str(exc).splitlines()[0][:160]}", False)
        assert chunks and chunks[0].choices[0].delta.role == "assistant", (
            "流式回答的第一个数据块没有宣布角色 assistant"
        )
        ends = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert ends == ["length"], f"流式回答的 finish_reason 应当恰好一次是 length，得到 {ends}"
        return "".join(c.choices[0].delta.content or "" for c in chunks)


@pytest.fixture
def client(capstone_server, pieces_dir) -> Client:
    return Client(capstone_server, pieces_dir)


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=WAIT, limits=httpx.Limits(max_connections=16))


SCOPE = ("q7", "q5", "q3", "q4")  # every answer passes through these


# ---------------------------------------------------------------- the checks
@pytest.mark.capstone(
    "非流式的回答完整到达",
    SCOPE,
    "非流式回答也走过你的请求作用域（q7）、监听（q5）、缓冲区（q3）和消费循环（q4）；"
    "先让 pytest tests/quiz --learner 全部通过",
)
async def test_a_whole_answer_arrives_complete(client, back_at_zero):
    async with http_client() as http:
        text = await client.whole(http, PROMPTS[0])
    assert text, "非流式回答的文本是空的"
    back_at_zero()


@pytest.mark.capstone(
    "流式的回答完整到达，和非流式的一字不差",
    ("q6", "q3", "q4"),
    "流式文本是各个输出的 text 依次拼起来：一段也不能丢、不能重复；"
    "每个数据块都要是合法的 chat.completion.chunk",
)
async def test_a_streamed_answer_equals_the_whole_one(client, back_at_zero):
    async with http_client() as http:
        whole = await client.whole(http, PROMPTS[0])
        streamed = await client.streamed(http, PROMPTS[0])
    assert streamed == whole, f"流式文本和非流式的不一样：{streamed[:60]!r} 对 {whole[:60]!r}"
    back_at_zero()


@pytest.mark.capstone(
    "同时进行的请求各自拿到自己的回答",
    ("q5", "q3", "q4"),
    "交错到达的回复（A1 B1 B2 A2）只能进入它自己 uid 的缓冲区，并叫醒那个请求的消费者",
)
async def test_concurrent_answers_reach_their_own_requests(client, back_at_zero):
    jobs = PROMPTS * 3  # nine at once, streamed and whole
    async with http_client() as http:
        expected = {p: await client.whole(http, p) for p in PROMPTS}
        streams = asyncio.gather(*(client.streamed(http, p) for p in jobs))
        wholes = asyncio.gather(*(client.whole(http, p) for p in PROMPTS))
        got = await asyncio.gather(streams, wholes)
    for prompt, text in zip(jobs + PROMPTS, got[0] + got[1]):
        assert text == expected[prompt], (
            f"同时进行时，「{prompt}」得到的回答和它单独请求时的不一样：{text[:60]!r}"
        )
    back_at_zero()


@pytest.mark.capstone(
    "第一个字节之前的错误是真实的 HTTP 状态码",
    ("q6", "q3", "q7"),
    "错误随第一个输出到来时还一个字节都没发：用 to_http(error, 'messages') 回答 JSON 错误；"
    "只带着终止、没有文本的回复也必须叫醒消费者",
)
async def test_an_error_before_the_first_byte_is_an_http_status(client, back_at_zero):
    body = client.body("x" * (MAX_SEQ_LEN + 50), stream=True)  # longer than the context
    async with http_client() as http:
        try:
            r = await http.post(client.url, json=body)
        except httpx.TimeoutException:
            pytest.fail(f"一个过长的流式请求等了 {WAIT:.0f} 秒也没有得到回答", False)
    assert r.status_code == 400, client.refused(r, "一个过长的流式请求（应当是 400）")
    kind = r.headers["content-type"]
    assert kind.startswith("application/json"), f"400 的 content-type 应当是 JSON，得到 {kind}"
    assert r.json()["error"]["code"] == "context_length_exceeded", f"错误体不对：{r.text[:160]}"
    back_at_zero()


@pytest.mark.capstone(
    "流式输出中途断开的客户端不留下任何状态",
    ("q7", "q5"),
    "客户端断开时，服务任务在 yield 处被取消：清理要写在 finally 里，当场删除状态，"
    "终止回复还没到时恰好发一次 AbortMsg；迟到的回复不能创建状态",
)
def test_a_client_leaving_mid_stream_leaves_nothing(client, back_at_zero):
    body = client.body(PROMPTS[1], LONG, stream=True)
    with httpx.Client(timeout=WAIT) as http, http.stream("POST", client.url, json=body) as r:
        if r.status_code != 200:
            r.read()
            pytest.fail(client.refused(r, "流式请求"), False)
        chunks = 0
        for payload in iter_payloads(r.iter_lines()):
            chunks += payload.startswith("{")
            if chunks == 2:
                running = lifecycle(client.server, client.pieces)["scheduler"]["running"]
                assert running >= 1, "读到第二个数据块时请求就已经结束了：断开得太晚"
                break  # leaving the block closes the connection mid-stream
    back_at_zero()


@pytest.mark.capstone(
    "等待整个回答时断开的客户端不留下任何状态",
    ("q7", "q4"),
    "非流式回答在收集输出时被取消：取消穿过你的消费循环和请求作用域，"
    "作用域的 finally 删除状态并发出 AbortMsg",
)
def test_a_client_leaving_a_whole_answer_leaves_nothing(client, back_at_zero):
    server = client.server
    before = lifecycle(server, client.pieces)["frontend"]["requests"]
    data = json.dumps(client.body(PROMPTS[2], LONG)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + data)
        deadline = time.monotonic() + WAIT
        while True:  # until the request is in the frontend and the scheduler generates
            state = lifecycle(server, client.pieces)
            if state["frontend"]["requests"] > before and state["scheduler"]["running"]:
                break
            assert time.monotonic() < deadline, f"请求一直没有开始生成：{nonzero(state)}"
            time.sleep(0.02)
    # the socket is closed while the answer is being collected: the client is gone
    back_at_zero()
