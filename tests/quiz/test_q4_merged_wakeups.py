"""Quiz question 4: several set() merged into one wake-up lose no reply.

Checks `wait_for_ack(state)` (exercise q4) over a real RequestState fed by minisgl's
listener: five replies between two wake-ups come out as one output holding all five;
a reply that lands while the consumer is away (right after it took, while its caller
writes to the client) wakes it again, so nothing is stranded in the buffer; with nothing
pending the consumer really waits on the event: while nothing arrives it is suspended
once and stays so (every suspension of its `anext` is counted: a loop that polls on a
timer, or spins on `asyncio.sleep(0)`, suspends again and again), and a reply wakes it
at once, not at the next tick of a timer; a consumer that holds the event loop without
ever awaiting is stopped after a while with a message saying so; the generator ends after
the terminal output.

A consumer still waiting after a timeout fails the check instead of hanging the run. The
last test runs the same check on the order the question asks about (take, await, clear).
"""

from __future__ import annotations

import asyncio
import signal
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from quiz_material import FAULTY_DIR, load

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.buffer import Output, ReplyBuffer
from minisgl.server.frontend import RequestState
from minisgl.testing.fakes import listening, make_frontend, settle

pytestmark = pytest.mark.q4

PIECES = ["什么", "是 ", "KV", " Cache", "？"]
Loop = Callable[[RequestState], AsyncIterator[Output]]
IDLE_ROUNDS = 50  # loop iterations with nothing arriving
IDLE_SECONDS = 0.1  # and real time with nothing arriving: a timer-driven poll wakes in it
HOLD_LIMIT = 3  # seconds a consumer may hold the event loop before the test stops it


def make_msg(uid: int) -> TokenizeMsg:
    return TokenizeMsg(uid, SamplingParams())


def reply(uid: int, i: int, last: bool = False) -> UserReply:
    return UserReply(
        uid,
        PIECES[i],
        finished=last,
        finish_reason="stop" if last else None,
        completion_tokens=i + 1,
    )


@dataclass
class SignallingBuffer(ReplyBuffer):
    """A ReplyBuffer that tells the test each time the consumer took from it."""

    taken: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> Output:
        self.taken.set()
        return super().take()


async def replies_right_after_each_take(wait_for_ack: Loop, timeout: float) -> list[str]:
    """Feed a request whose next reply arrives as soon as the consumer has taken the
    previous output and gives the loop a chance; return the texts the consumer got.
    Raises asyncio.TimeoutError if the consumer is still waiting after `timeout` s."""
    state = RequestState(0, buffer=SignallingBuffer())

    async def listener() -> None:
        for i in range(len(PIECES)):
            if i > 0:
                await state.buffer.taken.wait()
                state.buffer.taken.clear()
            if state.buffer.append(reply(0, i, last=i == len(PIECES) - 1)):
                state.event.set()  # what minisgl's `listen` does for each reply

    async def consumer() -> list[str]:
        texts = []
        async for out in wait_for_ack(state):
            texts.append(out.text)
            await asyncio.sleep(0)  # writing the output to the client
        return texts

    feeding = asyncio.create_task(listener())
    try:
        return await asyncio.wait_for(consumer(), timeout)
    finally:
        feeding.cancel()


@types.coroutine
def counting(awaitable: Awaitable, suspensions: list[int]):
    """Await `awaitable`, adding 1 to suspensions[0] each time it suspends (gives the
    event loop back until something wakes it)."""
    it = awaitable.__await__()
    value, error = None, None
    while True:
        try:
            step = it.throw(error) if error is not None else it.send(value)
        except StopIteration as done:
            return done.value
        suspensions[0] += 1
        value, error = None, None
        try:
            value = yield step
        except BaseException as exc:  # cancellation: pass it in
            error = exc


@contextmanager
def loop_hold_limit(seconds: float) -> Iterator[None]:
    """Stop a consumer that holds the event loop (a loop without an await) after
    `seconds`, instead of hanging the whole run."""

    def stop(signum, frame):
        raise AssertionError(
            f"消费者占住事件循环 {seconds} 秒都没有 await：它在一个没有 `await` 的循环里"
            "空转，监听协程永远没法送来回复"
        )

    previous = signal.signal(signal.SIGALRM, stop)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # pytest-timeout's, if any
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # give the outer alarm back what it had left
            left = outer - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))


# the order the question asks about (take, let the loop run, then clear): a faulty design
take_await_clear = load(FAULTY_DIR / "q4_take_await_clear.py").wait_for_ack


# ---------------------------------------------------------------- exercise q4


async def test_five_replies_one_wakeup_one_output_holding_all_five(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        async with frontend.request(make_msg) as state:
            for i in range(len(PIECES)):  # five arrivals, five set(), no await between
                backend.inject(reply(state.uid, i))
            await settle()
            outputs = exercise.wait_for_ack(state)
            with loop_hold_limit(HOLD_LIMIT):
                out = await asyncio.wait_for(anext(outputs), 2.0)
            assert out.text == "".join(PIECES), (
                f"五条回复在等着，一次唤醒应该把五条全部取走；拿到的是 {out.text!r}"
            )
            assert out.completion_tokens == len(PIECES), "输出里的 token 数是旧的"
            assert state.buffer.pending_bytes == 0, "取走之后，缓冲区里还留着文本"
            await outputs.aclose()


async def test_a_reply_landing_while_the_consumer_is_away_is_not_lost(exercise):
    try:
        with loop_hold_limit(HOLD_LIMIT):
            texts = await replies_right_after_each_take(exercise.wait_for_ack, timeout=2.0)
    except asyncio.TimeoutError:
        pytest.fail("一次唤醒丢了：回复躺在缓冲区里，事件却已经复位，消费者永远等着")
    assert "".join(texts) == "".join(PIECES), f"回复丢了或者乱了顺序：拿到的是 {texts}"
    assert all(texts), "一个没有新内容的输出：白白唤醒了一次"


async def test_with_nothing_pending_the_consumer_waits_on_the_event(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        async with frontend.request(make_msg) as state:
            outputs = exercise.wait_for_ack(state)
            backend.inject(reply(state.uid, 0))
            with loop_hold_limit(HOLD_LIMIT):
                first = await asyncio.wait_for(anext(outputs), 2.0)
            assert first.text == PIECES[0], f"应该是第一条回复的文本，拿到的是 {first.text!r}"

            suspensions = [0]
            nxt = asyncio.ensure_future(counting(anext(outputs), suspensions))
            with loop_hold_limit(HOLD_LIMIT):
                await settle(IDLE_ROUNDS)  # nothing arrives: loop iterations ...
                await asyncio.sleep(IDLE_SECONDS)  # ... and real time
            assert not nxt.done(), "没有新东西可取，循环却继续往下走了"
            idle = suspensions[0]
            backend.inject(reply(state.uid, 1))
            await settle()  # the listener sets the event; a waiting consumer runs at once
            assert idle <= 1, (
                f"没有新东西可取，消费者却醒了 {idle - 1} 次：它在轮询或空转"
                "（睡在定时器或 asyncio.sleep(0) 上），而不是等在事件上"
            )
            assert nxt.done(), (
                "回复到了、事件也置位了，消费者却没有醒：它睡在定时器上轮询缓冲区，而不是等在事件上"
            )
            assert nxt.result().text == PIECES[1]
            await outputs.aclose()


async def test_the_generator_ends_after_the_terminal_output(exercise):
    frontend, backend = make_frontend()
    async with listening(frontend):
        async with frontend.request(make_msg) as state:
            backend.inject(reply(state.uid, 0), reply(state.uid, 1, last=True))

            async def every_output() -> list[Output]:
                return [out async for out in exercise.wait_for_ack(state)]

            try:
                with loop_hold_limit(HOLD_LIMIT):
                    outputs = await asyncio.wait_for(every_output(), 1.0)
            except asyncio.TimeoutError:
                pytest.fail("终止输出已经来了，生成器却还在等")
    assert len(outputs) == 1 and outputs[0].finished, (
        "两条回复（包括终止回复）都在等着被取：应该只有一个输出，而且是终止输出"
    )
    assert outputs[0].text == "".join(PIECES[:2]), f"文本丢了：拿到的是 {outputs[0].text!r}"
    assert frontend.states == {} and backend.aborts() == []


# ---------------------------------------------------------------- the contrast


async def test_an_event_is_a_flag_five_sets_one_wakeup():
    event, woken = asyncio.Event(), 0

    async def waiter():
        nonlocal woken
        while True:  # wakes as often as the event is found set
            await event.wait()
            event.clear()
            woken += 1

    task = asyncio.create_task(waiter())
    for _ in range(5):
        event.set()  # no await in between: the waiter cannot run
    await settle()
    task.cancel()
    assert woken == 1  # five set() calls, one wake-up


async def test_contrast_take_await_clear_under_the_same_check():
    with pytest.raises(asyncio.TimeoutError):
        await replies_right_after_each_take(take_await_clear, timeout=0.3)
