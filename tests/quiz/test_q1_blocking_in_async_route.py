"""Q1：为什么把同步生成函数放进 async def 路由后，仍然可能阻塞其他连接？指出需要让出执行权的位置。

答：一个事件循环在一个线程里轮流运行所有协程，只有协程执行到 await（而且确实要等）时才会
交回执行权。`async def` 里直接调用同步的生成函数，这段时间内没有任何 await，事件循环停在
原地：别的连接的处理函数、计时协程都一步也走不了。让出执行权的位置是"等待"本身：等后端
回复（`await` 一个 future / 事件，minisgl 的路由就是这样等 ZMQ 上的 UserReply），或者把同步
计算交给别的线程 / 进程再 `await` 它（`asyncio.to_thread`、独立的 scheduler 进程）。

这里不看耗时（耗时阈值会随机器负载抖动），而看事件循环在处理函数运行期间有没有前进：
一个计时协程每轮循环加一；处理函数记下开始和结束时的计数；另一个请求 /ping 的处理函数
是在第一个请求结束前还是结束后才开始运行。
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI
from quiz_helpers import answer, answer_queries, app_client, chat_body

from minisgl.testing.fakes import make_frontend, wait_until

pytestmark = pytest.mark.q1


def blocking_generate(done: threading.Event) -> str:
    """Stands for model compute in the API process: holds its thread until `done` is set."""
    done.wait(timeout=5)
    return "generated"


class Probe:
    """Counts event-loop iterations and records when handlers start and end."""

    def __init__(self) -> None:
        self.ticks = 0
        self.log: list[str] = []
        self.ticks_during: dict[str, int] = {}
        self.started = asyncio.Event()

    async def ticker(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)  # one tick per loop iteration in which others could run

    def enter(self, name: str) -> int:
        self.log.append(f"{name}:start")
        self.started.set()
        return self.ticks

    def leave(self, name: str, ticks_at_start: int) -> None:
        self.log.append(f"{name}:end")
        self.ticks_during[name] = self.ticks - ticks_at_start


def make_app(probe: Probe, done: threading.Event, reply: asyncio.Future) -> FastAPI:
    app = FastAPI()

    @app.post("/blocking")
    async def blocking():
        t0 = probe.enter("blocking")
        text = blocking_generate(done)  # no await: the loop is stuck right here
        probe.leave("blocking", t0)
        return {"text": text}

    @app.post("/awaiting")
    async def awaiting():
        t0 = probe.enter("awaiting")
        text = await reply  # yields: like minisgl's routes awaiting the backend's reply
        probe.leave("awaiting", t0)
        return {"text": text}

    @app.post("/offloaded")
    async def offloaded():
        t0 = probe.enter("offloaded")
        text = await asyncio.to_thread(blocking_generate, done)  # compute elsewhere, await it
        probe.leave("offloaded", t0)
        return {"text": text}

    @app.get("/ping")
    async def ping():
        probe.log.append("ping")
        return {"pong": True}

    return app


async def run_scenario(route: str) -> Probe:
    """Start `route`; once its handler runs, send /ping; then let the slow one finish."""
    probe, done = Probe(), threading.Event()
    reply = asyncio.get_running_loop().create_future()
    app = make_app(probe, done, reply)
    ticker = asyncio.create_task(probe.ticker())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://q1") as client:
        if route == "blocking":  # nothing on this loop could set it: another thread does
            threading.Timer(0.05, done.set).start()
        slow = asyncio.create_task(client.post(f"/{route}"))
        await probe.started.wait()  # the slow handler has begun
        assert (await client.get("/ping")).status_code == 200
        done.set()  # "generation is over" (for the thread)
        if not reply.done():
            reply.set_result("generated")  # "the backend's reply arrived" (for the await)
        assert (await slow).json() == {"text": "generated"}
    ticker.cancel()
    return probe


async def test_a_blocking_call_in_async_def_freezes_the_event_loop():
    probe = await run_scenario("blocking")
    # while the handler ran, not one other coroutine took a step ...
    assert probe.ticks_during["blocking"] == 0
    # ... so the second connection's handler could start only after the first ended
    assert probe.log == ["blocking:start", "blocking:end", "ping"]


async def test_awaiting_the_reply_lets_other_connections_run_meanwhile():
    probe = await run_scenario("awaiting")
    assert probe.ticks_during["awaiting"] > 0
    assert probe.log == ["awaiting:start", "ping", "awaiting:end"]


async def test_the_same_sync_function_offloaded_and_awaited_no_longer_blocks():
    probe = await run_scenario("offloaded")
    assert probe.ticks_during["offloaded"] > 0
    assert probe.log == ["offloaded:start", "ping", "offloaded:end"]


async def test_minisgl_serves_other_connections_while_a_chat_request_waits():
    """Our chat route only awaits the backend: while a request waits for its reply, the
    same loop answers /health and /debug/lifecycle."""
    frontend, backend = make_frontend()
    answer_queries(backend)
    async with app_client(frontend) as client:
        chat = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body()))
        await wait_until(lambda: len(frontend.states) == 1)  # submitted, no reply yet
        assert (await client.get("/health")).json() == {"status": "ok"}
        lifecycle = (await client.get("/debug/lifecycle")).json()
        assert lifecycle["frontend"]["requests"] == 1 and not chat.done()

        answer(backend, ["KV", " Cache"])  # now the backend answers, the request completes
        (msg,) = backend.tokenized()
        backend.on_tokenize(msg)
        resp = await chat
    assert resp.json()["choices"][0]["message"]["content"] == "KV Cache"
    assert frontend.states == {}
