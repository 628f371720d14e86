"""Quiz question 5: interleaved replies of A and B reach only their own request, and no
component keeps state once the requests are over.

Checks `route(states, replies)` (exercise q5), the listener's work for one batch:
- called directly on two RequestStates: A1 B1 B2 A2 (one batch or four) leave A1A2 in A's
  buffer and B1B2 in B's, both marked terminal; a reply for an unknown uid, or after the
  terminal one, is dropped and creates no state; a reply without news wakes nobody;
- as the listener of a FrontendManager, between the real TokenizerWorker (a one-character
  tokenizer) and a fake scheduler (quiz_pipeline.py): each consumer gets exactly its own
  text, and afterwards the three components hold nothing for A or B: the frontend's
  `states`, the worker's decode states, the scheduler's running uids. If B is cancelled
  after B1, exactly one AbortMsg (for B) is sent and a token already in flight for B is
  dropped everywhere.

For contrast, the same runs with the reference's design (`naive.RefStyleManager` and a
worker that forwards an abort but keeps the decode state): every reply still reaches its
request, but state is left behind: in the frontend's maps after a normal end, in the
worker's decode states after a cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing, asynccontextmanager

import pytest
from naive import RefStyleManager
from quiz_pipeline import Pipeline, RefStyleTokenizerWorker

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.frontend import FrontendManager, RequestState
from minisgl.testing.fakes import settle, wait_until

pytestmark = pytest.mark.q5

TEXT = {"A": "ab", "B": "xy"}  # one character per token: A1 = "a", B2 = "y", ...
SCENARIOS = ["a1_b1_b2_a2", "a1_b1_b2_a2_in_one_batch", "b_cancelled_after_b1"]
Route = Callable[[dict[int, RequestState], list[UserReply]], None]


def reply(uid: int, text: str, last: bool = False) -> UserReply:
    return UserReply(uid, text, finished=last, finish_reason="stop" if last else None)


def make_msg(name: str) -> Callable[[int], TokenizeMsg]:
    return lambda uid: TokenizeMsg(uid, SamplingParams(), text=name)


# ---------------------------------------------------------------- exercise q5, directly


@pytest.mark.parametrize("one_batch", [False, True], ids=["four_batches", "one_batch"])
def test_a1_b1_b2_a2_each_request_gets_only_its_own(exercise, one_batch):
    states = {uid: RequestState(uid) for uid in (3, 8)}
    order = [reply(3, "A1"), reply(8, "B1"), reply(8, "B2", True), reply(3, "A2", True)]
    for batch in [order] if one_batch else [[r] for r in order]:
        exercise.route(states, batch)
    assert set(states) == {3, 8}, f"route 不能增加或删除状态：{sorted(states)}"
    a, b = states[3], states[8]
    texts = (a.buffer.take().text, b.buffer.take().text)
    assert texts == ("A1A2", "B1B2"), (
        f"A1 B1 B2 A2 必须只到达各自的请求，并保持顺序；A 得到 {texts[0]!r}，B 得到 {texts[1]!r}"
    )
    assert a.event.is_set() and b.event.is_set(), "一个请求有了新东西，却没有被叫醒"
    assert a.terminal and b.terminal, (
        "终止回复必须把状态标记为 terminal：否则它的作用域会为一个已经结束的请求发 AbortMsg"
    )


def test_a_reply_for_a_uid_without_state_is_dropped_and_creates_none(exercise):
    states = {3: RequestState(3)}
    exercise.route(states, [reply(99, "late"), reply(3, "A1")])
    assert list(states) == [3], (
        f"迟到的回复（uid 99 没有状态）创建了状态：{sorted(states)}；没有哪个作用域会删除它"
    )
    assert states[3].buffer.take().text == "A1", "迟到的回复后面那条回复丢了"


def test_a_reply_after_the_terminal_one_is_dropped(exercise):
    state = RequestState(3)
    exercise.route({3: state}, [reply(3, "A1", last=True)])
    state.event.clear()
    assert state.buffer.take().text == "A1", "终止回复的文本没有送到"
    exercise.route({3: state}, [reply(3, "late")])
    assert state.buffer.pending_bytes == 0 and not state.event.is_set(), (
        "终止回复之后的回复是迟到的：必须丢掉，而不是送进缓冲区"
    )


def test_a_reply_without_news_wakes_nobody(exercise):
    state = RequestState(3)
    exercise.route({3: state}, [UserReply(3, "", completion_tokens=1)])  # counts only
    assert not state.event.is_set(), "为一条没有新东西的回复叫醒了消费者（append 返回的是 False）"
    assert not state.terminal, "一条不是终止回复的回复把状态标记成了 terminal"
    exercise.route({3: state}, [reply(3, "A1")])
    assert state.event.is_set(), "一条带文本的回复没有叫醒消费者"


# ---------------------------------------------------------------- three components


async def play(pipe: Pipeline, a: int, b: int, scenario: str, cancel_b) -> None:
    """The scheduler samples A1 B1 B2 A2 (or cancels B after B1), one step at a time."""
    sample, steps = pipe.scheduler.sample, [(a, "a", False), (b, "x", False)]
    if scenario == "a1_b1_b2_a2_in_one_batch":
        sample(*steps, (b, "y", True), (a, "b", True))
        await settle()
        return
    for step in steps:
        sample(step)
        await settle()
    if scenario == "b_cancelled_after_b1":
        await cancel_b()
        pipe.scheduler.late(b, "y")  # computed before the abort reached the scheduler
    else:
        sample((b, "y", True))
    await settle()
    sample((a, "b", True))
    await settle()


async def until_done(tasks: Iterable[asyncio.Task], listener: asyncio.Task) -> None:
    """Wait for the consumers; a listener that died raises its error here. Consumers that
    do not end are cancelled, so that a failing test leaves no task behind."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    try:
        while not all(t.done() for t in tasks):
            if listener.done():
                listener.result()  # the listener's error, if it raised one
                raise AssertionError("监听协程停了")
            assert loop.time() < deadline, "有个消费者还在等：某条回复没有到达它的请求"
            await asyncio.sleep(0.005)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def routed_by(route: Route, frontend: FrontendManager, pipe: Pipeline):
    """A listener that hands each batch from the tokenizer worker to `route`."""

    async def listen() -> None:
        while True:
            route(frontend.states, await pipe.backend.recv())

    task = asyncio.create_task(listen())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


Run = tuple[dict[str, str], dict[str, int], list[int], int]  # texts, leftovers, aborts, B


def leftovers(pipe: Pipeline, frontend: int) -> dict[str, int]:
    """What each component still holds: uids in the frontend, decode states, running uids."""
    return {
        "frontend": frontend,
        "tokenizer": pipe.worker_state(),
        "scheduler": len(pipe.scheduler.running),
    }


async def run_ours(route: Route, scenario: str) -> Run:
    pipe = Pipeline()
    frontend = FrontendManager(pipe.backend.send, pipe.backend.recv)
    got = {name: "" for name in TEXT}

    async def consume(name: str) -> None:
        async with frontend.request(make_msg(name)) as state:
            async with aclosing(frontend.wait_for_ack(state)) as outputs:
                async for out in outputs:
                    got[name] += out.text

    async with routed_by(route, frontend, pipe) as listener:
        tasks = {name: asyncio.create_task(consume(name)) for name in TEXT}
        await settle()
        uid = {m.text: m.uid for m in pipe.backend.tokenized()}

        async def cancel_b() -> None:  # what a disconnect does to B's serving task
            tasks["B"].cancel()
            await asyncio.gather(tasks["B"], return_exceptions=True)

        await play(pipe, uid["A"], uid["B"], scenario, cancel_b)
        await until_done(tasks.values(), listener)
        left = leftovers(pipe, frontend=len(frontend.states))
    return got, left, pipe.backend.aborts(), uid["B"]


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_through_three_components_each_gets_its_own_and_nothing_is_left(exercise, scenario):
    got, left, aborts, b = await run_ours(exercise.route, scenario)
    cancelled = scenario == "b_cancelled_after_b1"
    want = {"A": TEXT["A"], "B": TEXT["B"][:1] if cancelled else TEXT["B"]}
    assert got == want, f"每个消费者必须恰好得到自己的文本：得到 {got}，应为 {want}"
    assert left == {"frontend": 0, "tokenizer": 0, "scheduler": 0}, (
        f"请求都结束了，还留着状态：{left}"
    )
    assert aborts == ([b] if cancelled else []), (
        f"为 {aborts} 发了 AbortMsg：只有在终止回复之前离开的请求（被取消的 B）"
        "才被中止，而且恰好一次"
    )


# ---------------------------------------------------------------- the reference's design


async def run_reference(scenario: str) -> Run:
    pipe = Pipeline(RefStyleTokenizerWorker)
    manager = RefStyleManager(pipe.backend.send, pipe.backend.recv)
    got = {name: "" for name in TEXT}

    async def is_disconnected() -> bool:
        return False  # B's client leaves the other way: the web server cancels its task

    async def chunks(uid: int) -> AsyncIterator[str]:  # the reference's generators break
        async for item in manager.wait_for_ack(uid):  # right after `finished`
            yield item.incremental_output
            if item.finished:
                break

    async def consume(name: str, uid: int) -> None:
        stream = manager.stream_with_cancellation(chunks(uid), is_disconnected, uid)
        async for text in stream:
            got[name] += text

    uid = {}
    for name in TEXT:  # the reference's route: a uid, then the TokenizeMsg
        uid[name] = manager.new_user()
        manager.send([make_msg(name)(uid[name])])
    listener = asyncio.create_task(manager.listen())
    tasks = {name: asyncio.create_task(consume(name, uid[name])) for name in TEXT}

    async def cancel_b() -> None:
        tasks["B"].cancel()
        await asyncio.gather(tasks["B"], return_exceptions=True)

    await play(pipe, uid["A"], uid["B"], scenario, cancel_b)
    await until_done(tasks.values(), listener)
    if scenario == "b_cancelled_after_b1":  # its cleanup comes later, in another task
        await wait_until(lambda: pipe.backend.aborts() != [])
    listener.cancel()
    left = leftovers(pipe, frontend=len(set(manager.ack_map) | set(manager.event_map)))
    return got, left, pipe.backend.aborts(), uid["B"]


async def test_the_reference_after_a_normal_end_leaves_both_uids_in_the_frontend_maps():
    got, left, aborts, _ = await run_reference("a1_b1_b2_a2")
    assert got == TEXT  # routing is right ...
    assert left == {"frontend": 2, "tokenizer": 0, "scheduler": 0}  # ... cleanup is not
    assert aborts == []


async def test_the_reference_after_a_cancel_leaves_the_decode_state_in_the_worker():
    got, left, aborts, b = await run_reference("b_cancelled_after_b1")
    assert got == {"A": TEXT["A"], "B": TEXT["B"][:1]}
    # A broke after `finished`: its maps stay; B's abort came 0.1 s later and freed the
    # scheduler, but the worker kept B's decode state
    assert left == {"frontend": 1, "tokenizer": 1, "scheduler": 0}
    assert aborts == [b]
