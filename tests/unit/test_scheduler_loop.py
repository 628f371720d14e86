"""Scheduler.run_forever driven by a scripted in-memory io: aborts stop output at once,
validation errors do not disturb the batch, state queries are answered, and the loop only
blocks when it has nothing to do. The loop ends the way the process's own does: the io's
blocking receive raises (`ScriptEnded`, as ZmqSchedulerIO raises ParentGone), here once the
script is used up and the loop has gone idle."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from tiny import tiny_cpu_engine

from minisgl.core import SamplingParams
from minisgl.engine.engine import Engine
from minisgl.message import (
    AbortBackendMsg,
    BackendErrorMsg,
    DetokenizeMsg,
    ErrorKind,
    SchedulerStateMsg,
    StateQueryMsg,
    UserMsg,
)
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig

ZERO = {"pending": 0, "running": 0, "table_slots_used": 0, "kv_pages_used": 0}
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    return tiny_cpu_engine(tiny_dirs["llama"], max_seq_len=MAX_SEQ_LEN)


@pytest.fixture
def sched(engine) -> Scheduler:
    return Scheduler(engine, SchedulerConfig(max_prefill_tokens=8))


@dataclass
class WhenIdle:
    """A scripted batch held back until the loop asks with blocking=True."""

    msgs: list


class ScriptEnded(Exception):
    """The script is used up and the loop asks to wait for more: it has finished its work."""


@dataclass
class ScriptedIO:
    """receive() hands out the script one entry per call (a plain list at once, a WhenIdle
    only to a blocking call), and raises ScriptEnded at the first blocking call after the
    script; every call and every send is logged in order."""

    sched: Scheduler
    script: list
    log: list = field(default_factory=list)  # ("recv", blocking, has_work, msgs) | ("send", r)
    max_calls: int = 2000

    def receive(self, blocking: bool) -> list:
        self.max_calls -= 1
        if self.max_calls < 0:
            raise AssertionError("the loop never reached the end of its script")
        msgs: list = []
        if self.script:
            head = self.script[0]
            if not isinstance(head, WhenIdle):
                msgs = self.script.pop(0)
            elif blocking:
                msgs = self.script.pop(0).msgs
        self.log.append(("recv", blocking, bool(self.sched.has_work), list(msgs)))
        if blocking and not msgs and not self.script:
            raise ScriptEnded
        return msgs

    def send(self, replies: list) -> None:
        assert replies, "send is only called with something to send"
        self.log.append(("send", list(replies)))

    @property
    def sent(self) -> list:
        return [m for entry in self.log if entry[0] == "send" for m in entry[1]]

    def sent_for(self, uid: int) -> list:
        return [m for m in self.sent if getattr(m, "uid", None) == uid]


def _user(uid: int, n: int, **params) -> UserMsg:
    return UserMsg.make(uid, [(uid * 7 + j) % 400 + 3 for j in range(n)], SamplingParams(**params))


def _live(sched: Scheduler) -> dict[str, int]:
    state = sched.state()
    return {k: getattr(state, k) for k in ZERO}


def _run(sched: Scheduler, script: list) -> ScriptedIO:
    io = ScriptedIO(sched, script)
    with pytest.raises(ScriptEnded):  # idle, with nothing left in the script
        sched.run_forever(io)
    assert io.script == [], "the loop stopped before its script ended"
    return io


def test_abort_while_decoding_stops_output_after_the_abort_and_frees_all(sched) -> None:
    script = [
        WhenIdle([_user(1, 6, max_tokens=40, ignore_eos=True)]),
        [],
        [],
        [],
        [],
        [AbortBackendMsg(1)],
        WhenIdle([StateQueryMsg(9)]),
    ]
    io = _run(sched, script)

    abort_at = next(
        i for i, e in enumerate(io.log) if e[0] == "recv" and AbortBackendMsg(1) in e[3]
    )
    before = [m for e in io.log[:abort_at] if e[0] == "send" for m in e[1]]
    after = [m for e in io.log[abort_at:] if e[0] == "send" for m in e[1]]
    assert len(before) >= 3 and all(isinstance(m, DetokenizeMsg) for m in before)
    assert all(m.finish_reason is None for m in before)  # it was still decoding
    assert not any(isinstance(m, DetokenizeMsg) and m.uid == 1 for m in after)
    (state,) = [m for m in after if isinstance(m, SchedulerStateMsg)]
    assert {k: getattr(state.state, k) for k in ZERO} == ZERO
    assert _live(sched) == ZERO


def test_an_over_long_prompt_mid_batch_errors_alone_and_the_others_complete(sched) -> None:
    script = [
        WhenIdle(
            [
                _user(1, 5, max_tokens=4, ignore_eos=True),
                _user(2, MAX_SEQ_LEN, max_tokens=4),  # no room left to generate
                _user(3, 7, max_tokens=3, ignore_eos=True),
            ]
        ),
    ]
    io = _run(sched, script)

    (error,) = io.sent_for(2)
    assert isinstance(error, BackendErrorMsg)
    assert error.error.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED
    for uid, n in ((1, 4), (3, 3)):
        replies = io.sent_for(uid)
        assert all(isinstance(m, DetokenizeMsg) for m in replies)
        assert [m.finish_reason for m in replies] == [None] * (n - 1) + ["length"]
    assert not any(isinstance(m, BackendErrorMsg) for m in io.sent_for(1) + io.sent_for(3))
    assert _live(sched) == ZERO


def test_the_error_reply_goes_out_with_the_first_step_not_after_the_batch(sched) -> None:
    # a token id past the vocabulary: what the scheduler itself refuses (the sampling
    # values' own rules are checked before a request reaches it)
    bad = UserMsg.make(2, [5, 10**6], SamplingParams())
    script = [
        WhenIdle([_user(1, 5, max_tokens=10, ignore_eos=True), bad]),
    ]
    io = _run(sched, script)
    first_send = next(e[1] for e in io.log if e[0] == "send")
    assert any(isinstance(m, BackendErrorMsg) and m.uid == 2 for m in first_send)
    assert _live(sched) == ZERO


def test_a_state_query_is_answered_with_live_counts(sched) -> None:
    script = [
        WhenIdle([StateQueryMsg(1)]),
        WhenIdle([_user(5, 5, max_tokens=20, ignore_eos=True)]),
        [],
        [StateQueryMsg(2)],
        [AbortBackendMsg(5)],
        WhenIdle([StateQueryMsg(3)]),
    ]
    io = _run(sched, script)
    states = {m.query_id: m.state for m in io.sent if isinstance(m, SchedulerStateMsg)}
    assert sorted(states) == [1, 2, 3]
    total = sched.engine.num_pages
    cache = ("kv_pages_cached", "prefix_cache_nodes")
    live = {**ZERO, "kv_pages_total": total}
    # as /debug/lifecycle shows it: no flushed_pages (no flush), no ranks (one rank)
    assert {k: v for k, v in msgspec.to_builtins(states[1]).items() if k not in cache} == {
        **live,
        "prefix_cache_query_tokens": 0,
        "prefix_cache_hit_tokens": 0,
        "grammar_matchers": 0,
    }
    assert states[1].kv_pages_cached == states[1].prefix_cache_nodes == 0
    assert states[2].running == 1 and states[2].table_slots_used == 1
    assert states[2].kv_pages_used > 0 and states[2].kv_pages_total == total
    assert states[2].prefix_cache_query_tokens == 5  # its prompt, looked up once
    assert {k: getattr(states[3], k) for k in live} == live
    # what the cache still holds after the abort, it holds alone
    assert states[3].kv_pages_cached == states[3].prefix_cache_nodes


def test_the_loop_blocks_only_when_it_has_no_work(sched) -> None:
    script = [
        WhenIdle([_user(1, 30, max_tokens=3, ignore_eos=True)]),  # chunked: 4 prefill steps
        WhenIdle([_user(2, 5, max_tokens=2, ignore_eos=True)]),
    ]
    io = _run(sched, script)
    recvs = [e for e in io.log if e[0] == "recv"]
    for _, blocking, has_work, _ in recvs:
        assert blocking is (not has_work)
    # idle; uid 1 prefills in 4 chunks (the last samples token 1) then decodes 2 tokens: 5
    # more steps; idle; uid 2 prefills with token 1 then decodes 1 more: 1 more step; idle
    pattern = "".join("B" if blocking else "n" for _, blocking, _, _ in recvs)
    assert pattern == "B" + "n" * 5 + "B" + "n" + "B"
    assert _live(sched) == ZERO


def test_abort_of_a_uid_that_never_existed_is_ignored(sched) -> None:
    script = [
        WhenIdle([AbortBackendMsg(12345)]),
        WhenIdle([_user(1, 5, max_tokens=3, ignore_eos=True), AbortBackendMsg(777)]),
        [AbortBackendMsg(4242)],
    ]
    io = _run(sched, script)
    assert all(m.uid == 1 for m in io.sent)  # no reply of any kind for unknown uids
    assert [m.finish_reason for m in io.sent_for(1)] == [None, None, "length"]
    assert _live(sched) == ZERO


def test_an_idle_loop_waits_and_sends_nothing(sched) -> None:
    io = _run(sched, [])
    assert io.log == [("recv", True, False, [])]
