"""Overlap scheduling keeps the lifecycle contract.

With overlap the scheduler launches step N+1 before it reads step N's tokens, so a request
can end (abort, stop token, length) while a launched step still holds it. These tests drive
the real scheduler and engine on a CPU with overlap forced on and inject an abort at every
point of the overlapped loop: between two `advance()` calls (where the process loop takes
messages: a step is in flight then), and inside `advance()` after the next step is
launched but before the previous step's tokens are read (a fake ordering: our loop takes no
message there today, but a receiver on another thread would). Each time: no token of
the aborted request after its abort, the other requests' tokens unchanged, and every page
and slot back, freed once (the allocator and the slot table raise on a double free).
"""

from __future__ import annotations

import pytest
from tiny import tiny_cpu_engine

from minisgl.core import SamplingParams
from minisgl.engine.engine import Engine
from minisgl.message import AbortBackendMsg, DetokenizeMsg, UserMsg
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig

ZERO = {"pending": 0, "running": 0, "table_slots_used": 0, "kv_pages_used": 0}
PROMPTS = {1: 9, 2: 14, 3: 5}  # uid -> prompt length; 14 tokens take two chunks of 8


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    return tiny_cpu_engine(tiny_dirs["llama"])


def _sched(engine: Engine, overlap: bool, **config) -> Scheduler:
    return Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=8, overlap_schedule=overlap, **config)
    )


def _user(uid: int, n: int, **params) -> UserMsg:
    params = {"max_tokens": 10, "ignore_eos": True} | params
    return UserMsg.make(uid, [(uid * 7 + j) % 400 + 3 for j in range(n)], SamplingParams(**params))


def _live(sched: Scheduler) -> dict[str, int]:
    state = sched.state()
    return {k: getattr(state, k) for k in ZERO}


def _tokens(replies: list, uid: int) -> list[int]:
    return [r.next_token for r in replies if isinstance(r, DetokenizeMsg) and r.uid == uid]


def _run(sched: Scheduler, inject=None, limit: int = 200) -> list:
    """Admit PROMPTS, then advance until idle; `inject(call, sched)` runs before each
    advance() and inside it between launch and read (call numbers: 2k before, 2k+1 inside)."""
    replies: list = []
    calls = iter(range(10**6))
    if inject is not None:
        real_take = sched._take_in_flight

        def take_in_flight():
            inject(next(calls), sched)  # the next step is launched; the previous is unread
            return real_take()

        sched._take_in_flight = take_in_flight  # an instance attribute: this scheduler only
    try:
        for uid, n in PROMPTS.items():
            assert sched.process_msg(_user(uid, n)) == []
        for _ in range(limit):
            if not sched.has_work:
                return replies
            if inject is not None:
                inject(next(calls), sched)
            replies += sched.advance()
        raise AssertionError("the scheduler did not become idle")
    finally:
        sched.__dict__.pop("_take_in_flight", None)


@pytest.fixture(scope="module")
def reference(engine) -> list:
    return _run(_sched(engine, overlap=False))


def test_overlap_gives_the_same_tokens_one_step_later(engine, reference) -> None:
    sched = _sched(engine, overlap=True)
    replies = _run(sched)
    for uid in PROMPTS:
        assert _tokens(replies, uid) == _tokens(reference, uid)
        assert len(_tokens(replies, uid)) == 10
    assert _live(sched) == ZERO


@pytest.mark.parametrize("at", range(0, 24))
def test_abort_at_every_point_of_the_overlapped_loop(engine, reference, at) -> None:
    sched = _sched(engine, overlap=True)
    seen_at_abort: list[int] = []

    def inject(call: int, s: Scheduler) -> None:
        if call == at:
            s.process_msg(AbortBackendMsg(2))
            seen_at_abort.append(len(_tokens(replies_so_far, 2)))

    replies_so_far: list = []
    # collect replies as they come so the abort point is known
    real_advance = sched.advance

    def advance():
        out = real_advance()
        replies_so_far.extend(out)
        return out

    sched.advance = advance
    replies = _run(sched, inject)
    assert seen_at_abort, "the abort was injected"
    got = _tokens(replies, 2)
    # nothing of uid 2 after its abort, and what came before is a prefix of its tokens
    assert len(got) == seen_at_abort[0]
    assert got == _tokens(reference, 2)[: len(got)]
    for uid in (1, 3):  # the others are untouched
        assert _tokens(replies, uid) == _tokens(reference, uid)
    assert _live(sched) == ZERO


def test_a_stop_token_seen_one_step_late_emits_nothing_more(engine, reference) -> None:
    # uid 1 stops at its 3rd token; under overlap its 4th step is already launched when
    # the 3rd token is read: that step's token must be dropped and its pages freed once
    stop_at = _tokens(reference, 1)[2]
    sched = _sched(engine, overlap=True)
    for uid, n in PROMPTS.items():
        params = {"stop_token_ids": [stop_at]} if uid == 1 else {}
        sched.process_msg(_user(uid, n, **params))
    replies: list = []
    while sched.has_work:
        replies += sched.advance()
    first_stop = _tokens(reference, 1).index(stop_at)
    assert _tokens(replies, 1) == _tokens(reference, 1)[: first_stop + 1]
    (last,) = [r for r in replies if r.uid == 1 and r.finish_reason is not None]
    assert last.finish_reason == "stop" and last.next_token == stop_at
    assert _live(sched) == ZERO


def test_a_length_finish_is_not_run_past_its_last_token(engine) -> None:
    # a prompt of 60 in a 64-token context: 4 tokens. The 4th is still pending when the
    # next step is scheduled; it ends the sequence by length, so no step may feed it to the
    # model (a wasted step, and past max_len for a shorter max_tokens)
    sched = _sched(engine, overlap=True)
    fed: list[int] = []  # tokens of uid 7 in the cache after each launched step
    real_launch = sched.engine.launch

    def launch(batch):
        fed.extend(r.cached_len + r.extend_len for r in batch.reqs if r.uid == 7)
        return real_launch(batch)

    sched.engine.launch = launch
    try:
        sched.process_msg(_user(7, 60, max_tokens=100))
        replies: list = []
        while sched.has_work:
            replies += sched.advance()
    finally:
        del sched.engine.launch
    assert len(_tokens(replies, 7)) == 4
    assert replies[-1].finish_reason == "length"
    assert max(fed) == 63  # the 4th token (position 63) was never an input
    assert _live(sched) == ZERO


def test_preempted_with_a_pending_token_then_finished_leaves_no_trace(tiny_dirs) -> None:
    # 8 pages of 4 tokens for three growing requests: decodes preempt the newest, whose
    # last token is still pending; every request still gets its tokens and all is freed
    small = tiny_cpu_engine(tiny_dirs["llama"], num_pages=8, max_seq_len=32)
    expected = _run(_sched(small, overlap=False))
    sched = _sched(small, overlap=True)
    replies = _run(sched)
    assert sched.policy.num_preemptions > 0
    for uid in PROMPTS:
        assert _tokens(replies, uid) == _tokens(expected, uid)
    assert _live(sched) == ZERO
