"""The FrontendManager's lifecycle contract, GPU-free, against a fake tokenizer worker.

A FakeBackend records what the frontend sends (TokenizeMsg, AbortMsg, LifecycleQueryMsg)
and feeds `listen()` whatever UserReply batches a test injects, in any order. Every test
ends by checking that no per-uid state is left and that AbortMsg went out exactly when a
request was left before its terminal reply (chapters/architecture/, 生命周期约定).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.message import (
    ErrorInfo,
    ErrorKind,
    Lifecycle,
    LifecycleStateMsg,
    TokenizeMsg,
    UserReply,
)
from minisgl.server.errors import RequestFailed, to_http
from minisgl.server.frontend import FrontendManager, Output
from minisgl.server.memory import text_bytes
from minisgl.server.stalls import StallSweeper
from minisgl.testing.fakes import listening, make_frontend, scheduler_state, settle

ZERO = {"requests": 0, "pending_bytes": 0}


@pytest.fixture
async def fb():
    frontend, backend = make_frontend()
    async with listening(frontend):
        yield frontend, backend


def prompt(tag: str):
    """A make_msg for `frontend.request`; the tag finds the request's uid in `backend.sent`."""
    return lambda uid: TokenizeMsg(uid, SamplingParams(), text=tag)


def uid_of(backend, tag: str) -> int:
    (msg,) = [m for m in backend.tokenized() if m.text == tag]
    return msg.uid


def done(uid: int, text: str = "", n: int = 0, **kw) -> UserReply:
    return UserReply(uid, text, finished=True, finish_reason="stop", completion_tokens=n, **kw)


async def consume(frontend: FrontendManager, tag: str, outs: list[Output], gate=None) -> None:
    """One request's consumer; with a `gate`, it blocks on it after each output (a slow send)."""
    async with frontend.request(prompt(tag)) as state:
        async for out in frontend.wait_for_ack(state):
            outs.append(out)
            if gate is not None:
                await gate.wait()


# ---------------------------------------------------------------- routing by uid


async def test_interleaved_replies_a1_b1_b2_a2_reach_only_their_own_consumer(fb):
    frontend, backend = fb
    outs: dict[str, list[Output]] = {"A": [], "B": []}
    tasks = [asyncio.create_task(consume(frontend, t, outs[t])) for t in "AB"]
    await settle()
    a, b = uid_of(backend, "A"), uid_of(backend, "B")
    for msg in [UserReply(a, "A1", completion_tokens=1), UserReply(b, "B1", completion_tokens=1)]:
        backend.inject(msg)
        await settle()
    for msg in [done(b, "B2", 2), done(a, "A2", 2)]:
        backend.inject(msg)
        await settle()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)

    assert [o.text for o in outs["A"]] == ["A1", "A2"]
    assert [o.text for o in outs["B"]] == ["B1", "B2"]
    for seq in outs.values():
        assert [o.finished for o in seq] == [False, True]
        assert seq[-1].finish_reason == "stop" and seq[-1].completion_tokens == 2
    assert frontend.states == {} and frontend.state() == ZERO
    assert backend.aborts() == []  # both finished normally: nothing to abort


PIECE = st.text(st.characters(codec="utf-8"), max_size=4)  # "" and multi-byte text included


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_interleaving_and_wakeup_merging_delivers_each_request_exactly_its_text(data):
    reqs = data.draw(
        st.lists(st.tuples(st.lists(PIECE, max_size=5), PIECE), min_size=1, max_size=6),
        label="(pieces, final piece) per request",
    )
    # the global arrival order: request i appears once per reply, its own order kept
    order = data.draw(
        st.permutations([i for i, (p, _) in enumerate(reqs) for _ in range(len(p) + 1)])
    )
    # after each reply: 0 = same recv batch, 1 = next batch without yielding, 2 = yield to the loop
    steps = data.draw(
        st.lists(st.sampled_from([0, 1, 2]), min_size=len(order), max_size=len(order))
    )

    async def scenario():
        frontend, backend = make_frontend()
        outs: list[list[Output]] = [[] for _ in reqs]
        async with listening(frontend):
            tasks = [
                asyncio.create_task(consume(frontend, f"r{i}", outs[i])) for i in range(len(reqs))
            ]
            await settle()
            uids = [uid_of(backend, f"r{i}") for i in range(len(reqs))]
            sent = [0] * len(reqs)
            batch: list[UserReply] = []
            for i, step in zip(order, steps):
                pieces, last = reqs[i]
                k = sent[i]
                sent[i] += 1
                if k < len(pieces):
                    msg = UserReply(
                        uids[i], pieces[k], prompt_tokens=3 + i, completion_tokens=k + 1
                    )
                else:
                    msg = done(uids[i], last, k + 1, prompt_tokens=3 + i)
                batch.append(msg)
                if step:
                    backend.inject(*batch)
                    batch = []
                if step == 2:
                    await asyncio.sleep(0)
            if batch:
                backend.inject(*batch)
            await settle(50)  # no timers anywhere: a consumer still waiting now is stuck
            stuck = [i for i, t in enumerate(tasks) if not t.done()]
            for t in tasks:
                t.cancel()
            assert stuck == [], f"requests {stuck} never saw their terminal output"
            assert frontend.states == {} and frontend.state() == ZERO
            assert backend.aborts() == []
        for i, (pieces, last) in enumerate(reqs):
            got = outs[i]
            assert "".join(o.text for o in got) == "".join(pieces) + last
            assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
            assert all(o.text for o in got[:-1])  # a wake-up always brings something
            assert got[-1].completion_tokens == len(pieces) + 1
            assert got[-1].prompt_tokens == 3 + i and got[-1].finish_reason == "stop"

    asyncio.run(scenario())


async def test_several_sets_merged_into_one_wakeup_lose_no_reply(fb):
    """Quiz Q4: the event is a flag, not a counter; the buffer keeps every reply."""
    frontend, backend = fb
    pieces = ["什么", "是 ", "KV", " Cache", "？🐳"]
    async with frontend.request(prompt("q4")) as state:
        for i, p in enumerate(pieces):  # five separate arrivals, no await in between
            backend.inject(UserReply(state.uid, p, completion_tokens=i + 1))
        await settle()
        assert state.event.is_set()
        assert state.buffer.pending_bytes == sum(text_bytes(p) for p in pieces)
        assert frontend.state()["pending_bytes"] == state.buffer.pending_bytes

        outputs = frontend.wait_for_ack(state)
        out = await anext(outputs)  # one wake-up ...
        assert out.text == "".join(pieces) and out.completion_tokens == 5  # ... all five
        assert not out.finished and not state.event.is_set()
        assert state.buffer.pending_bytes == 0 and frontend.state()["pending_bytes"] == 0

        nxt = asyncio.ensure_future(anext(outputs))
        await settle()
        assert not nxt.done()  # nothing was left behind for a second wake-up
        backend.inject(done(state.uid, "", 5))
        last = await asyncio.wait_for(nxt, 1)
        assert last.finished and last.text == ""
        await outputs.aclose()
    assert frontend.states == {} and backend.aborts() == []


# ---------------------------------------------------------------- early exit, cancellation


async def test_break_right_after_finished_leaks_no_state_and_sends_no_abort(fb):
    """Chapter 5.1: the generator is left suspended at its yield; the scope still cleans up."""
    frontend, backend = fb
    async with frontend.request(prompt("x")) as state:
        backend.inject(UserReply(state.uid, "a", completion_tokens=1), done(state.uid, "b", 2))
        async for out in frontend.wait_for_ack(state):
            if out.finished:
                break
        assert out.text == "ab"
    assert frontend.states == {} and frontend.state() == ZERO
    assert backend.aborts() == []


async def test_break_before_finished_removes_state_and_aborts_once(fb):
    frontend, backend = fb
    async with frontend.request(prompt("x")) as state:
        uid = state.uid
        backend.inject(UserReply(uid, "a", completion_tokens=1))
        async for out in frontend.wait_for_ack(state):
            assert out.text == "a"
            break
    assert frontend.states == {}
    assert backend.aborts() == [uid]
    backend.inject(UserReply(uid, "late", completion_tokens=2), done(uid, "", 2))
    await settle()
    assert frontend.states == {} and backend.aborts() == [uid]


# where the consumer task is when it is cancelled, what has arrived, and whether it aborts
CANCEL_POINTS = {
    "before_any_reply": ([], False, False),
    "after_some_replies_taken": (["a", "b"], False, False),
    "pending_while_sending": (["a", "b"], True, False),  # blocked in a send, output waits
    "pending_woken_not_run": (["a", "b"], "woken", False),  # event set, consumer not yet run
    "terminal_while_sending": (["a", None], True, True),  # None: the terminal reply
    "terminal_woken_not_run": (["a", None], "woken", True),
}


@pytest.mark.parametrize("point", list(CANCEL_POINTS))
async def test_cancellation_at_every_await_point_cleans_up_and_aborts_iff_not_terminal(fb, point):
    frontend, backend = fb
    replies, blocked, terminal = CANCEL_POINTS[point]
    outs: list[Output] = []
    gate = asyncio.Event() if blocked is True else None  # never set: the send never returns
    task = asyncio.create_task(consume(frontend, "c", outs, gate))
    await settle()
    uid = uid_of(backend, "c")
    state = frontend.states[uid]

    if replies:
        backend.inject(UserReply(uid, replies[0], completion_tokens=1))
        await settle()
        assert [o.text for o in outs] == [replies[0]]
        second = (
            done(uid, "z", 2) if replies[1] is None else UserReply(uid, "b", completion_tokens=2)
        )
        backend.inject(second)
        if blocked == "woken":
            while not state.event.is_set():  # the listener ran; the consumer has not yet
                await asyncio.sleep(0)
        else:
            await settle()
        if blocked:
            assert state.buffer.pending_bytes > 0 and state.event.is_set()
            assert state.terminal == terminal
        else:
            assert [o.text for o in outs] == ["a", "b"]

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert frontend.states == {} and frontend.state() == ZERO
    assert backend.aborts() == ([] if terminal else [uid])

    backend.inject(UserReply(uid, "late", completion_tokens=9), done(uid, "", 9))
    await settle()
    assert frontend.states == {}  # late replies never recreate state
    assert backend.aborts() == ([] if terminal else [uid])


async def test_an_exception_inside_the_scope_aborts_and_removes_state(fb):
    frontend, backend = fb
    with pytest.raises(ValueError, match="cannot format"):
        async with frontend.request(prompt("x")) as state:
            uid = state.uid
            backend.inject(UserReply(uid, "a", completion_tokens=1))
            async for _ in frontend.wait_for_ack(state):
                raise ValueError("cannot format this output")
    assert frontend.states == {} and backend.aborts() == [uid]


async def test_a_failing_make_msg_leaves_no_state(fb):
    frontend, backend = fb

    def broken(uid: int) -> TokenizeMsg:
        raise RuntimeError("cannot build the message")

    with pytest.raises(RuntimeError):
        async with frontend.request(broken):
            pass
    assert frontend.states == {} and backend.tokenized() == []


# ---------------------------------------------------------------- late and stray replies


async def test_replies_for_unknown_uids_are_dropped_and_create_no_state(fb):
    frontend, backend = fb
    backend.inject(UserReply(4242, "stray", completion_tokens=1), done(4243, "stray", 1))
    await settle()
    assert frontend.states == {}
    async with frontend.request(prompt("x")) as state:
        backend.inject(UserReply(state.uid + 100, "not mine", completion_tokens=1))
        await settle()
        assert set(frontend.states) == {state.uid}
        assert state.buffer.pending_bytes == 0 and not state.event.is_set()
        backend.inject(done(state.uid, "mine", 1))
        outs = [o async for o in frontend.wait_for_ack(state)]
    assert [o.text for o in outs] == ["mine"] and frontend.states == {}


async def test_a_reply_after_the_terminal_one_is_dropped(fb):
    frontend, backend = fb
    async with frontend.request(prompt("x")) as state:
        uid = state.uid
        backend.inject(done(uid, "end", 1), UserReply(uid, "after", completion_tokens=7))
        backend.inject(done(uid, "again", 8, prompt_tokens=99))
        await settle()
        outs = [o async for o in frontend.wait_for_ack(state)]
    assert [o.text for o in outs] == ["end"]
    assert outs[0].completion_tokens == 1 and outs[0].prompt_tokens == 0
    assert frontend.states == {} and backend.aborts() == []


# ---------------------------------------------------------------- bounded memory


async def test_past_max_pending_bytes_the_request_ends_with_slow_client_and_aborts_once():
    frontend, backend = make_frontend(max_pending_bytes=text_bytes("0123456789"))
    async with listening(frontend):
        async with frontend.request(prompt("slow")) as state:
            uid = state.uid
            backend.inject(UserReply(uid, "0123456789", completion_tokens=1))  # at the cap
            await settle()
            assert backend.aborts() == [] and not state.terminal
            backend.inject(UserReply(uid, "ab", completion_tokens=2))  # past it
            await settle()
            assert backend.aborts() == [uid] and state.terminal
            pending = state.buffer.pending_bytes
            backend.inject(UserReply(uid, "more", completion_tokens=3), done(uid, "x", 4))
            await settle()
            assert state.buffer.pending_bytes == pending  # dropped after the local end

            outs = [o async for o in frontend.wait_for_ack(state)]
            assert len(outs) == 1 and outs[0].finished
            assert outs[0].error is not None and outs[0].error.kind is ErrorKind.SLOW_CLIENT
            answer = to_http(outs[0].error)
            assert answer.code == "slow_client" and answer.status == 503
            assert "more" not in outs[0].text
        assert backend.aborts() == [uid]  # the scope exit sends no second AbortMsg
        assert frontend.states == {} and frontend.state() == ZERO


async def test_a_consumer_that_keeps_up_is_never_cut_off_by_the_cap():
    frontend, backend = make_frontend(max_pending_bytes=text_bytes("鲸鱼"))
    async with listening(frontend):
        outs: list[Output] = []
        task = asyncio.create_task(consume(frontend, "fast", outs))
        await settle()
        uid = uid_of(backend, "fast")
        for i in range(20):  # 20 pieces in all, never more than one waiting
            backend.inject(UserReply(uid, "鲸鱼", completion_tokens=i + 1))
            await settle()
        backend.inject(done(uid, "", 20))
        await asyncio.wait_for(task, 1)
    assert "".join(o.text for o in outs) == "鲸鱼" * 20 and outs[-1].error is None
    assert backend.aborts() == [] and frontend.states == {}


# ---------------------------------------------------------------- operations


async def test_fail_all_ends_every_live_request_promptly_and_refuses_new_ones(fb):
    frontend, backend = fb
    outs = {t: [] for t in ("taken", "pending", "idle")}
    gate = asyncio.Event()
    tasks = [
        asyncio.create_task(consume(frontend, "taken", outs["taken"])),
        asyncio.create_task(consume(frontend, "pending", outs["pending"], gate)),
        asyncio.create_task(consume(frontend, "idle", outs["idle"])),
    ]
    await settle()
    for tag in ("taken", "pending"):
        backend.inject(UserReply(uid_of(backend, tag), "x", completion_tokens=1))
    await settle()
    backend.inject(UserReply(uid_of(backend, "pending"), "y", completion_tokens=2))
    query = asyncio.create_task(frontend.lifecycle(timeout=5))
    await settle()

    error = ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, "the scheduler died")
    frontend.fail_all(error)
    gate.set()
    await settle()
    assert all(t.done() for t in tasks)  # promptly: no timer, no further reply needed
    for seq in outs.values():
        assert seq[-1].finished and seq[-1].error == error
    assert outs["pending"][-1].text == "y"
    with pytest.raises(RequestFailed, match="the scheduler died"):
        await query
    assert frontend.states == {} and backend.aborts() == []

    n_tokenized = len(backend.tokenized())
    with pytest.raises(RequestFailed, match="the scheduler died"):
        async with frontend.request(prompt("new")):
            pass
    with pytest.raises(RequestFailed, match="the scheduler died"):
        await frontend.lifecycle(timeout=0.1)
    assert len(backend.tokenized()) == n_tokenized and frontend.states == {}


async def test_the_stall_sweeper_cancels_only_a_send_blocked_past_the_timeout(fb):
    frontend, backend = fb
    sweeper = StallSweeper(timeout=5)
    frontend.observe(sweeper)
    loop = asyncio.get_running_loop()
    blocked_send = asyncio.Event()  # never set: the client reads nothing

    async def serve(tag: str, since: float | None):
        async with frontend.request(prompt(tag)) as state:
            if since is None:  # not sending
                await blocked_send.wait()
                return
            with frontend.sending(state):
                sweeper.sending[state.uid] = (state, asyncio.current_task(), since)  # began then
                await blocked_send.wait()

    now = loop.time()
    old = asyncio.create_task(serve("old", now - 10))
    recent = asyncio.create_task(serve("recent", now - 1))
    idle = asyncio.create_task(serve("idle", None))
    await settle()
    sweeper.check(now)
    await settle()
    assert old.cancelled()
    assert not recent.done() and not idle.done()
    assert set(frontend.states) == {uid_of(backend, "recent"), uid_of(backend, "idle")}
    assert backend.aborts() == [uid_of(backend, "old")]

    sweeper.check(now + 6)  # now the other one is stalled too
    await settle()
    assert recent.cancelled() and not idle.done()
    idle.cancel()
    await asyncio.gather(idle, return_exceptions=True)
    assert frontend.states == {} and len(backend.aborts()) == 3


async def test_lifecycle_combines_the_workers_answer_with_the_frontend_counts(fb):
    frontend, backend = fb
    async with frontend.request(prompt("live")) as state:
        backend.inject(UserReply(state.uid, "é", completion_tokens=1))  # one piece pending
        await settle()
        query = asyncio.create_task(frontend.lifecycle(timeout=1))
        await settle()
        (msg,) = backend.queries()
        stray = LifecycleStateMsg(msg.query_id + 1000, {"decode_states": 7}, scheduler_state())
        backend.inject(stray)
        tokenizer, scheduler = {"decode_states": 1}, scheduler_state(running=1)
        backend.inject(LifecycleStateMsg(msg.query_id, tokenizer, scheduler))
        result = await asyncio.wait_for(query, 1)
    pending = text_bytes("é")  # what the piece holds in memory
    assert result == Lifecycle({"requests": 1, "pending_bytes": pending}, tokenizer, scheduler)
    assert frontend._queries == {}


async def test_lifecycle_without_an_answer_times_out_and_forgets_the_query(fb):
    frontend, backend = fb
    with pytest.raises(asyncio.TimeoutError):
        await frontend.lifecycle(timeout=0.05)
    (msg,) = backend.queries()
    assert frontend._queries == {}
    backend.inject(LifecycleStateMsg(msg.query_id, {}, scheduler_state()))  # late: harmless
    await settle()
    assert frontend.states == {}
