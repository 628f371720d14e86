"""The scheduler through its message interface: what only the model can check (context
length, vocabulary; the sampling values' own rules are checked where a request enters:
tests/unit/test_request_rules.py), abort at every phase, clamping, continuous batching,
and every page and slot back in the pool afterwards."""

from __future__ import annotations

import dataclasses

import pytest
from msgspec import UNSET
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


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    return tiny_cpu_engine(tiny_dirs["llama"])


@pytest.fixture
def sched(engine) -> Scheduler:
    # a fresh scheduler over the shared engine: all managers start empty
    return Scheduler(engine, SchedulerConfig(max_prefill_tokens=8))


def _user(uid: int, n: int, **params) -> UserMsg:
    return UserMsg.make(uid, [(uid * 7 + j) % 400 + 3 for j in range(n)], SamplingParams(**params))


def _live(sched: Scheduler) -> dict[str, int]:
    state = sched.state()
    return {k: getattr(state, k) for k in ZERO}


def _run_until_idle(sched: Scheduler, limit: int = 500) -> list:
    replies = []
    for _ in range(limit):
        if not sched.has_work:
            return replies
        replies += sched.step()
    raise AssertionError("scheduler did not become idle")


def test_over_long_prompt_is_an_error_reply_not_silence(sched) -> None:
    (reply,) = sched.process_msg(_user(1, 64))
    assert isinstance(reply, BackendErrorMsg) and reply.uid == 1
    assert reply.error.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED and reply.error.field is None
    assert "64 tokens" in reply.error.message
    assert _live(sched) == ZERO


def test_empty_prompt_and_bad_token_ids_are_error_replies(sched) -> None:
    (empty,) = sched.process_msg(UserMsg.make(3, [], SamplingParams()))
    (bad,) = sched.process_msg(UserMsg.make(4, [5, 10**6], SamplingParams()))
    assert isinstance(empty, BackendErrorMsg) and "empty" in empty.error.message
    assert empty.error.kind is ErrorKind.EMPTY_PROMPT
    assert isinstance(bad, BackendErrorMsg) and "token ids" in bad.error.message
    assert bad.error.kind is ErrorKind.INVALID_TOKEN_ID and bad.error.field is None
    assert _live(sched) == ZERO


def test_max_tokens_above_the_room_left_is_clamped_and_ends_with_length(sched) -> None:
    assert sched.process_msg(_user(5, 60, max_tokens=1000, ignore_eos=True)) == []
    replies = _run_until_idle(sched)
    assert len(replies) == 4  # 64 - 60: exactly the room left
    assert [r.finish_reason for r in replies] == [None, None, None, "length"]
    assert _live(sched) == ZERO


def test_one_reply_per_step_per_uid_and_new_requests_join_running_ones(sched) -> None:
    sched.process_msg(_user(10, 5, max_tokens=6, ignore_eos=True))
    first = sched.step()
    assert [r.uid for r in first] == [10]
    sched.process_msg(_user(11, 5, max_tokens=3, ignore_eos=True))
    second = sched.step()  # 10 decodes while 11 prefills, in the same step
    assert sorted(r.uid for r in second) == [10, 11]
    for _ in range(10):
        replies = sched.step()
        uids = [r.uid for r in replies]
        assert len(uids) == len(set(uids))
    assert _live(sched) == ZERO


def test_abort_while_waiting_frees_everything(sched) -> None:
    for uid in range(4):  # fill all four slots
        sched.process_msg(_user(uid, 5, max_tokens=20, ignore_eos=True))
    while sched.state().running < 4:
        sched.step()
    sched.process_msg(_user(99, 5, max_tokens=20, ignore_eos=True))
    sched.step()
    assert sched.state().pending == 1  # no slot for 99: it waits
    assert sched.state().table_slots_used == 4
    sched.process_msg(AbortBackendMsg(99))
    assert sched.state().pending == 0
    for uid in range(4):
        sched.process_msg(AbortBackendMsg(uid))
    assert _live(sched) == ZERO


def test_abort_mid_chunked_prefill_frees_every_page_and_slot(sched) -> None:
    sched.process_msg(_user(20, 30, max_tokens=5))  # 30 tokens, budget 8: 4 chunks
    assert sched.step() == []  # first chunk: no token yet
    state = sched.state()
    assert state.pending == 1 and state.table_slots_used == 1
    assert state.kv_pages_used == 2  # 8 tokens in pages of 4
    sched.process_msg(AbortBackendMsg(20))
    assert _live(sched) == ZERO


def test_abort_while_decoding_frees_every_page_and_slot(sched) -> None:
    sched.process_msg(_user(30, 6, max_tokens=30, ignore_eos=True))
    for _ in range(4):
        (reply,) = sched.step()
        assert reply.finish_reason is None
    assert sched.state().running == 1
    sched.process_msg(AbortBackendMsg(30))
    assert _live(sched) == ZERO
    assert sched.step() == []  # nothing more is produced for the aborted uid


def test_abort_of_an_unknown_or_finished_uid_is_ignored(sched) -> None:
    sched.process_msg(_user(40, 5, max_tokens=2, ignore_eos=True))
    _run_until_idle(sched)
    sched.process_msg(AbortBackendMsg(40))  # late: already finished
    sched.process_msg(AbortBackendMsg(12345))  # never existed
    assert _live(sched) == ZERO


def test_state_query_answers_with_live_counts(sched) -> None:
    sched.process_msg(_user(50, 5, max_tokens=3))
    sched.step()
    (reply,) = sched.process_msg(StateQueryMsg(query_id=7))
    assert isinstance(reply, SchedulerStateMsg) and reply.query_id == 7
    assert reply.state.running == 1 and reply.state.kv_pages_total == sched.engine.num_pages
    assert reply.state.flushed_pages is UNSET and reply.state.ranks is UNSET  # one rank
    sched.process_msg(AbortBackendMsg(50))


def test_a_flushing_state_query_reports_the_pages_freed_and_counts_after_the_flush(sched):
    sched.process_msg(_user(51, 9, max_tokens=3, ignore_eos=True))
    sched.step()
    (busy,) = sched.process_msg(StateQueryMsg(1, flush_cache=True))
    assert busy.state.flushed_pages == -1  # mid-prefill: nothing flushed
    assert busy.state.pending == 1 and busy.state.prefix_cache_nodes > 0
    _run_until_idle(sched)
    cached = sched.state().kv_pages_cached
    assert cached > 0  # the finished request's full pages stay in the prefix cache
    (reply,) = sched.process_msg(StateQueryMsg(2, flush_cache=True))
    assert reply.state.flushed_pages == cached
    assert reply.state.kv_pages_cached == reply.state.prefix_cache_nodes == 0
    assert _live(sched) == ZERO


def test_eos_ends_a_request_with_stop(engine) -> None:
    # make every token an end token: the first sampled token must finish the request
    sched = Scheduler(engine)
    every = frozenset(range(engine.model_config.vocab_size))
    sched.policy.limits = dataclasses.replace(sched.policy.limits, eos_token_ids=every)
    sched.process_msg(_user(60, 5, max_tokens=10))
    (reply,) = _run_until_idle(sched)
    assert isinstance(reply, DetokenizeMsg) and reply.finish_reason == "stop"
    assert _live(sched) == ZERO


def test_a_sequence_s_status_is_set_at_every_transition_and_names_its_holder(
    tiny_dirs, monkeypatch
) -> None:
    """`Req.status` follows each sequence through waiting, chunked prefill, running,
    preemption (9 pages for requests that need more), forking n choices, then finished or
    aborted, only along the transitions core.py names; between steps a sequence is in the
    manager its status names, and in no manager once it ended."""
    from minisgl.core import Req, ReqStatus
    from minisgl.scheduler import choices, policy

    W, PF, R, P = ReqStatus.WAITING, ReqStatus.PREFILLING, ReqStatus.RUNNING, ReqStatus.PREEMPTED
    F, A = ReqStatus.FINISHED, ReqStatus.ABORTED
    allowed = {(W, PF), (W, R), (PF, R), (PF, W), (R, P), (P, PF), (P, R), (R, F), (P, F)}
    allowed |= {(s, A) for s in (W, PF, R, P)}
    traces: list[tuple[Req, list[ReqStatus]]] = []

    class Traced(Req):
        def __setattr__(self, name, value) -> None:
            if name == "status":
                if "status" not in self.__dict__:
                    traces.append((self, []))
                next(t for r, t in traces if r is self).append(value)
            super().__setattr__(name, value)

    monkeypatch.setattr(policy, "Req", Traced)
    monkeypatch.setattr(choices, "Req", Traced)  # the forked choices
    small = tiny_cpu_engine(tiny_dirs["llama"], num_pages=9, max_seq_len=32)
    sched = Scheduler(small, SchedulerConfig(max_prefill_tokens=8))
    for uid, length, n in ((1, 14, 1), (2, 9, 1), (3, 5, 2), (4, 6, 1)):
        params = SamplingParams(max_tokens=10, ignore_eos=True, n=n)
        assert sched.process_msg(UserMsg.make(uid, [3 + j for j in range(length)], params)) == []
    sched.process_msg(AbortBackendMsg(4))  # while it waits
    for _ in range(200):
        if not sched.has_work:
            break
        sched.step()
        assert all(r.status in (W, PF, P) for r in sched.policy.prefill_manager.pending)
        assert all(r.status is R for r in sched.policy.decode_manager.running.values())
        held = {
            id(r)
            for r in (
                *sched.policy.prefill_manager.pending,
                *sched.policy.decode_manager.running.values(),
            )
        }
        assert all(id(r) not in held for r, _ in traces if r.ended)
    assert not sched.has_work and sched.policy.num_preemptions > 0
    assert len(traces) == 5  # four requests, one of them with a forked second choice
    for req, trace in traces:
        steps = [s for i, s in enumerate(trace) if i == 0 or s is not trace[i - 1]]
        assert steps[0] is W and steps[-1] in (F, A), (req, steps)
        assert all(pair in allowed for pair in zip(steps, steps[1:])), (req, steps)
    assert {s for _, t in traces for s in t} == {W, PF, R, P, F, A}
    assert [r.status for r, _ in traces if r.uid == 4] == [A]
    assert _live(sched) == ZERO
