"""Quiz question 1: a blocking call inside an `async def` route stalls every connection.

Checks `generate_off_the_loop(generate, prompt)` (exercise q1): it returns what the
synchronous `generate` returns and passes on its exceptions; while `generate` holds its
thread, the event loop keeps running (a ticker coroutine keeps counting); and a FastAPI
route that calls it answers a second connection (/ping) before the first one ends.

For contrast, on the same app: a route that calls the same function directly inside
`async def`, and a route that awaits a reply; and minisgl's chat route, with /health and
/debug/lifecycle asked while a chat request waits for its reply. No timing thresholds:
the tests count loop iterations and record the order in which handlers start and end.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import httpx
import pytest
from fastapi import FastAPI
from quiz_helpers import answer, answer_queries, app_client, chat_body

from minisgl.testing.fakes import make_frontend, wait_until

pytestmark = pytest.mark.q1

FALLBACK = 2.0  # seconds: a thread ends a blocked call then, so no test can hang


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


def slow_generate(done: threading.Event) -> Callable[[str], str]:
    """Stands for model compute: holds its thread until `done` is set."""

    def generate(prompt: str) -> str:
        done.wait(timeout=5)
        return f"generated for {prompt}"

    return generate


def make_app(probe: Probe, done: threading.Event, reply: asyncio.Future, exercise) -> FastAPI:
    app = FastAPI()
    generate = slow_generate(done)

    @app.post("/blocking")
    async def blocking():
        t0 = probe.enter("blocking")
        text = generate("q1")  # no await: the loop is stuck right here
        probe.leave("blocking", t0)
        return {"text": text}

    @app.post("/awaiting")
    async def awaiting():
        t0 = probe.enter("awaiting")
        text = await reply  # yields: like minisgl's routes awaiting the backend's reply
        probe.leave("awaiting", t0)
        return {"text": text}

    @app.post("/exercise")
    async def with_exercise():
        t0 = probe.enter("exercise")
        text = await exercise.generate_off_the_loop(generate, "q1")
        probe.leave("exercise", t0)
        return {"text": text}

    @app.get("/ping")
    async def ping():
        probe.log.append("ping")
        return {"pong": True}

    return app


async def run_scenario(route: str, exercise=None) -> Probe:
    """Start `route`; once its handler runs, send /ping; then let the slow one finish."""
    probe, done = Probe(), threading.Event()
    reply = asyncio.get_running_loop().create_future()
    app = make_app(probe, done, reply, exercise)
    ticker = asyncio.create_task(probe.ticker())
    # nothing on a blocked loop could set `done`: a thread does, after a while
    fallback = threading.Timer(0.05 if route == "blocking" else FALLBACK, done.set)
    fallback.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://q1") as client:
            slow = asyncio.create_task(client.post(f"/{route}"))
            await probe.started.wait()  # the slow handler has begun
            assert (await client.get("/ping")).status_code == 200
            done.set()  # "generation is over" (for the thread)
            if not reply.done():
                reply.set_result("generated for q1")  # "the reply arrived" (for the await)
            assert (await slow).json() == {"text": "generated for q1"}
    finally:
        fallback.cancel()
        ticker.cancel()
    return probe


# ---------------------------------------------------------------- the question's contrast


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


# ---------------------------------------------------------------- exercise q1


async def test_it_returns_what_generate_returns_and_passes_on_its_errors(exercise):
    got = await exercise.generate_off_the_loop(str.upper, "kv cache")
    assert got == "KV CACHE", f"它必须返回 generate 的返回值；它返回的是 {got!r}"

    def failing(prompt: str) -> str:
        raise ValueError(f"cannot generate for {prompt}")

    with pytest.raises(ValueError, match="cannot generate for q1"):
        await exercise.generate_off_the_loop(failing, "q1")


async def test_the_loop_keeps_running_while_generate_holds_its_thread(exercise):
    probe, done = Probe(), threading.Event()
    ticks: dict[str, int] = {}
    generate = slow_generate(done)

    def observed(prompt: str) -> str:  # runs wherever the exercise runs it
        ticks["start"] = probe.ticks
        text = generate(prompt)
        ticks["end"] = probe.ticks
        return text

    ticker = asyncio.create_task(probe.ticker())
    fallback = threading.Timer(FALLBACK, done.set)  # a blocked loop could not set it
    fallback.start()
    try:
        call = asyncio.create_task(exercise.generate_off_the_loop(observed, "q1"))
        await wait_until(lambda: "start" in ticks or call.done(), timeout=FALLBACK)
        for _ in range(10):
            await asyncio.sleep(0)  # ten loop iterations while generate still holds on
        done.set()
        assert await call == "generated for q1"
    finally:
        fallback.cancel()
        ticker.cancel()
    assert ticks["end"] - ticks["start"] > 0, (
        "generate 运行期间，事件循环一圈也没转：其他每个连接都只能等着"
    )


async def test_a_route_using_it_answers_another_connection_meanwhile(exercise):
    probe = await run_scenario("exercise", exercise)
    assert probe.ticks_during["exercise"] > 0, (
        "路由里的 generate 运行期间，事件循环一圈也没转：其他每个连接都只能等着"
    )
    assert probe.log == ["exercise:start", "ping", "exercise:end"], (
        f"第二个连接（/ping）要等第一个请求结束才得到回答（顺序：{probe.log}）：路由占住了事件循环"
    )


# ---------------------------------------------------------------- minisgl's route


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
