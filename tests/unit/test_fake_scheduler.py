"""The shared fake scheduler (minisgl.testing.fakes.FakeScheduler) that the quiz's pipeline
and the frontend benchmark's stand-in process run: the per-request rules of the real one."""

from __future__ import annotations

import msgspec

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    DetokenizeMsg,
    SchedulerStateMsg,
    StateQueryMsg,
    UserMsg,
)
from minisgl.testing.fakes import FakeScheduler, scheduler_state
from minisgl.testing.server import ZERO_FRONTEND, ZERO_TOKENIZER, is_zero

P = SamplingParams()


def _scheduler() -> tuple[FakeScheduler, list[list]]:
    frames: list[list] = []
    return FakeScheduler(frames.append), frames


def test_each_step_sends_one_frame_with_a_token_per_running_request() -> None:
    sched, frames = _scheduler()
    sched.handle([UserMsg.make(1, [5], SamplingParams(max_tokens=2)), UserMsg.make(2, [5], P)])
    assert sched.step(7) == 2 and sched.step(7) == 2
    assert frames == [
        [DetokenizeMsg(1, 7, None), DetokenizeMsg(2, 7, None)],
        [DetokenizeMsg(1, 7, "length"), DetokenizeMsg(2, 7, None)],
    ]
    assert list(sched.running) == [2]  # 16 tokens when max_tokens is unset
    for _ in range(FakeScheduler.DEFAULT_MAX_TOKENS - 2):
        sched.step(7)
    assert frames[-1] == [DetokenizeMsg(2, 7, "length")] and sched.running == {}
    assert sched.step(7) == 0 and len(frames) == FakeScheduler.DEFAULT_MAX_TOKENS


def test_an_idle_fake_scheduler_reads_as_zero_to_the_tests_check() -> None:
    sched, _ = _scheduler()

    def lifecycle() -> dict:  # as /debug/lifecycle shows it
        scheduler = msgspec.to_builtins(sched.state())
        return {"frontend": ZERO_FRONTEND, "tokenizer": ZERO_TOKENIZER, "scheduler": scheduler}

    assert is_zero(lifecycle())
    sched.handle([UserMsg.make(1, [5], P)])
    assert not is_zero(lifecycle())


def test_aborts_end_a_request_and_queries_see_the_live_counts() -> None:
    sched, frames = _scheduler()
    sched.handle([UserMsg.make(1, [5], P), UserMsg.make(2, [5], P), AbortBackendMsg(9)])
    sched.handle([AbortBackendMsg(1), StateQueryMsg(3)])
    assert frames == [[SchedulerStateMsg(3, scheduler_state(running=1, table_slots_used=1))]]
    sched.sample((1, 4, False), (2, 4, True))  # uid 1 is gone: only uid 2 samples
    sched.late(1, 4)  # computed before the abort: sent all the same
    assert frames[1:] == [[DetokenizeMsg(2, 4, "length")], [DetokenizeMsg(1, 4, None)]]
    assert sched.running == {}
