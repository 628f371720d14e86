"""Request timelines without a server: the API server's store (the ring of ended requests
is bounded, decode spans merge, nothing is recorded after a process's end), the scheduler's
events on a tiny model (ordered; finished, aborted, stopped, rejected and preempted
requests each end with the right end event and only once), the tokenizer worker's events,
and how the frontend names each way a request can end."""

from __future__ import annotations

import asyncio

import pytest
from tiny import make_tokenizer, tiny_cpu_engine

from minisgl.core import Batch, SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BackendErrorMsg,
    DetokenizeMsg,
    ErrorInfo,
    ErrorKind,
    TokenizeMsg,
    UserMsg,
    UserReply,
)
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.frontend import FrontendManager
from minisgl.server.memory import text_bytes
from minisgl.server.supervisor import end_all
from minisgl.testing.fakes import FakeBackend, listening, wait_until
from minisgl.timeline.api import ApiTimeline, Timelines
from minisgl.timeline.events import (
    END_EVENTS,
    Aborted,
    AnyEvent,
    Decode,
    End,
    Finished,
    FirstOutput,
    PrefillChunk,
    Queued,
    TimelineMsg,
)
from minisgl.timeline.scheduler import SchedulerTimeline
from minisgl.timeline.tokenizer import TokenizerTimeline
from minisgl.tokenizer.prepare import Preparation
from minisgl.tokenizer.server import TokenizerWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


# ---------------------------------------------------------------- the API server's store
def test_the_ring_of_ended_timelines_is_bounded_and_late_events_find_theirs():
    clock = Clock()
    store = Timelines(history=3, clock=clock)
    for uid in range(5):
        store.start(uid, f"r{uid}", "/v1/completions", clock(), clock())
        store.end(Finished(uid, "api", clock(), reason="stop"), 4, 2)
    snap = store.snapshot({})
    assert [t["uid"] for t in snap["ended"]] == [4, 3, 2]  # newest first, three kept
    assert snap["in_flight"] == []
    # the scheduler's end comes after the API server's: it joins its timeline in the ring;
    # for an evicted uid it is dropped, not an error
    store.add(TimelineMsg([Finished(4, "scheduler", clock()),
                           Finished(0, "scheduler", clock())]))  # fmt: skip
    (t4,) = [t for t in store.snapshot({})["ended"] if t["uid"] == 4]
    assert [e["event"] for e in t4["events"]] == ["received", "admitted", "finished", "finished"]
    assert store.late_events == 0


def test_an_answer_is_bounded_by_limit_and_since_asks_for_what_is_new():
    clock = Clock()
    store = Timelines(history=1000, clock=clock)
    for uid in range(300):
        store.start(uid, f"r{uid}", "/v1/completions", clock(), clock())
        if uid < 290:  # ten stay in flight
            store.end(Finished(uid, "api", clock(), reason="stop"), 4, 2)
    snap = store.snapshot({}, limit=50)
    assert len(snap["ended"]) == 50 and len(snap["in_flight"]) == 10
    assert [t["seq"] for t in snap["ended"][:3]] == [290, 289, 288]  # newest first
    assert (snap["ended_total"], snap["in_flight_total"]) == (290, 10)
    assert store.snapshot({}, limit=5)["in_flight"][-1]["uid"] == 294  # in flight too
    assert store.snapshot({}, since=290)["ended"] == []  # nothing ended since
    store.end(Aborted(295, "api", clock()), 4, 0)
    new = store.snapshot({}, since=290)["ended"]
    assert [(t["uid"], t["seq"]) for t in new] == [(295, 291)]
    (one,) = store.snapshot({}, request_id="r7")["ended"]
    assert one["uid"] == 7 and store.snapshot({}, request_id="nope")["ended"] == []


def test_nothing_is_recorded_after_a_process_ends_a_request():
    clock = Clock()
    store = Timelines(history=8, clock=clock)
    store.start(7, "r", "/v1/chat/completions", clock(), clock())
    store.add(TimelineMsg([Aborted(7, "scheduler", clock()),
                           Decode(7, "scheduler", clock(), tokens=1)]))  # fmt: skip
    store.record(7, FirstOutput)
    store.end(Aborted(7, "api", clock(), by="client_disconnect"), 3, 1)
    store.record(7, FirstOutput)  # ended: not live any more
    store.add(TimelineMsg([Finished(7, "api", clock())]))
    events = store.snapshot({})["ended"][0]["events"]
    assert [(e["process"], e["event"]) for e in events] == [
        ("api", "received"), ("api", "admitted"), ("scheduler", "aborted"),
        ("api", "first_output"), ("api", "aborted"),
    ]  # fmt: skip
    assert events[-1]["by"] == "client_disconnect"
    assert store.late_events == 2  # the decode after the abort, the second api end


def test_decode_spans_of_one_process_merge():
    clock = Clock()
    store = Timelines(history=8, clock=clock)
    store.start(1, "r", "/v1/completions", clock(), clock())
    spans = [Decode(1, "scheduler", clock(), tokens=5, t_end=clock()) for _ in range(4)]
    store.add(TimelineMsg(spans[:2]))
    store.add(TimelineMsg([FirstOutput(1, "tokenizer", clock()), *spans[2:]]))
    (decode,) = [e for e in store.snapshot({})["in_flight"][0]["events"] if e["event"] == "decode"]
    assert decode["tokens"] == 20
    assert decode["t"] < decode["t_end"] and decode["t_end"] == pytest.approx(
        spans[-1].t_end - 100.001, abs=1e-3
    )


def test_kv_samples_are_kept_once_a_second_for_five_minutes():
    store = Timelines(history=1, clock=lambda: 349.5)
    for t in range(0, 700, 1):
        store.add(TimelineMsg([], kv=(t / 2, t, 0, 1000)))  # two batches a second
    samples = store.snapshot({})["kv_pages"]
    assert 290 <= len(samples) <= 302
    assert all(-301 <= s[0] <= 0 for s in samples)


def test_history_zero_keeps_only_what_is_in_flight():
    store = Timelines(history=0)
    store.start(1, "r", "/v1/completions", 1.0, 1.0)
    assert len(store.snapshot({})["in_flight"]) == 1
    store.end(Finished(1, "api", 2.0), 1, 1)
    assert store.snapshot({})["ended"] == [] and store.snapshot({})["in_flight"] == []


# ---------------------------------------------------------------- the scheduler's events
@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return tiny_cpu_engine(tiny_dirs["llama"])


def _user(uid: int, length: int, **params) -> UserMsg:
    ids = [(uid * 7 + j) % 400 + 3 for j in range(length)]
    return UserMsg.make(uid, ids, SamplingParams(**params))


def _timed(engine, max_prefill_tokens: int, **options) -> tuple[Scheduler, SchedulerTimeline]:
    """A scheduler with a timeline observing it."""
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=max_prefill_tokens))
    timeline = SchedulerTimeline(sched.policy, **options)
    sched.observe(timeline)
    return sched, timeline


def _run(sched: Scheduler, msgs=(), until_idle=True, steps=None) -> list[AnyEvent]:
    for msg in msgs:
        sched.process_msg(msg)
    for _ in range(steps or 500):
        if until_idle and not sched.has_work:
            break
        sched.step()
    return [e for batch in sched.observer.outbox(True) for e in batch.events]


def _by_uid(events: list[AnyEvent]) -> dict[int, list[AnyEvent]]:
    out: dict[int, list[AnyEvent]] = {}
    for e in events:
        out.setdefault(e.uid, []).append(e)
    return out


def assert_well_formed(events: list[AnyEvent]) -> None:
    """Times never go back (a span may start before events that came before its end), and
    exactly one end event, the last."""
    ends = [e for e in events if isinstance(e, End)]
    assert len(ends) == 1 and events[-1] is ends[0], [e.event for e in events]
    assert {e.event for e in ends} <= END_EVENTS
    points = [e.t_end if isinstance(e, Decode) else e.t for e in events]
    assert points == sorted(points), [(e.event, e.t, points) for e in events]


def test_a_finished_request_is_queued_prefilled_decoded_and_finished(engine):
    sched, timeline = _timed(engine, 8)
    events = _run(sched, [_user(1, 20, max_tokens=6, ignore_eos=True)])
    assert_well_formed(events)
    names = [e.event for e in events]
    assert names[0] == "queued" and names[-1] == "finished"
    chunks = [e for e in events if isinstance(e, PrefillChunk)]
    assert [c.tokens for c in chunks] == [8, 8, 4]  # chunked by the budget
    steps = [c.step for c in chunks]
    assert steps == sorted(steps) and len(set(steps)) == 3
    assert names.index("first_token") > names.index("prefill")
    decoded = sum(e.tokens for e in events if isinstance(e, Decode))
    assert decoded == 6  # every output token counted once, decode spans included
    end = events[-1]
    assert isinstance(end, Finished) and end.timed
    assert end.reason == "length" and end.preemptions == 0
    assert end.queue_s >= 0 and end.prefill_s >= 0 and end.decode_s >= 0
    assert list(end.detail()) == ["reason", "preemptions", "queue_s", "prefill_s", "decode_s"]
    assert timeline.lives == {}


def test_every_way_of_ending_has_its_end_event(engine):
    sched, timeline = _timed(engine, 64)
    events = _run(sched, [
        _user(1, 9, max_tokens=40, ignore_eos=True),   # aborted after a few steps
        _user(2, 9, max_tokens=40, ignore_eos=True, n=2),  # both choices stopped by strings
        _user(3, 300, max_tokens=4),  # longer than the context: rejected
        _user(4, 9, max_tokens=3, ignore_eos=True, n=3),  # three choices finish
    ], until_idle=False, steps=3)  # fmt: skip
    events += _run(sched, [AbortBackendMsg(1), AbortBackendMsg(2, 0)], until_idle=False, steps=2)
    events += _run(sched, [AbortBackendMsg(2, 1)])
    timelines = _by_uid(events)
    for evs in timelines.values():
        assert_well_formed(evs)
    assert timelines[1][-1].event == "aborted"
    assert timelines[2][-1].event == "finished" and timelines[2][-1].reason == "stop"
    assert [e.event for e in timelines[3]] == ["queued", "error"]
    assert timelines[3][-1].detail() == {"kind": "context_length_exceeded"}
    assert timelines[3][0].detail() == {}  # refused at admission: queued, no counts
    assert timelines[4][-1].event == "finished" and timelines[4][-1].reason == "length"
    assert timeline.lives == {}
    # a late abort of an ended request adds nothing
    assert _run(sched, [AbortBackendMsg(4), AbortBackendMsg(1)]) == []


def test_an_abort_before_the_first_choice_forks_ends_all_its_choices(engine):
    sched, timeline = _timed(engine, 4)
    events = _run(sched, [_user(1, 30, max_tokens=5, n=4)], until_idle=False, steps=2)
    events += _run(sched, [AbortBackendMsg(1)])
    assert events[-1].event == "aborted" and timeline.lives == {}


def test_preempted_requests_say_so_and_are_readmitted(tiny_dirs):
    engine = tiny_cpu_engine(tiny_dirs["llama"], num_pages=12, page_size=4)
    sched, _ = _timed(engine, 64)
    users = [_user(uid, 8, max_tokens=14, ignore_eos=True) for uid in range(1, 4)]
    events = _run(sched, users)
    assert sched.policy.num_preemptions > 0
    timelines = _by_uid(events)
    preempted = [uid for uid, evs in timelines.items() if any(e.event == "preempted" for e in evs)]
    assert preempted
    for evs in timelines.values():
        assert_well_formed(evs)
        names = [e.event for e in evs]
        assert names.count("preempted") == names.count("readmitted") == evs[-1].preemptions
        if "preempted" in names:
            assert names.index("preempted") < names.index("readmitted")


def test_without_detail_only_what_the_metrics_need_is_recorded(engine):
    sched, _ = _timed(engine, 8, detailed=False)
    events = _run(sched, [_user(1, 20, max_tokens=6, ignore_eos=True)])
    assert [e.event for e in events] == ["queued", "first_token", "finished"]
    assert events[-1].timed


def test_a_batch_is_due_every_flush_period_and_when_idle():
    clock = Clock()
    timeline = SchedulerTimeline(clock=clock)
    assert not timeline.due(idle=True)  # nothing to say
    timeline.step(Batch([], decodes=5), 1)
    assert timeline.due(idle=True) and not timeline.due(idle=False)
    clock.now += SchedulerTimeline.FLUSH_S
    assert timeline.due(idle=False)
    msg = timeline.flush([], (1, 2, 3))
    assert msg.step_tokens == [5] and msg.kv[1:] == (1, 2, 3)
    assert not timeline.due(idle=True)


# ---------------------------------------------------------------- the tokenizer worker
def test_the_tokenizer_worker_adds_its_events_to_what_it_passes_on(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    sent: list = []
    worker = TokenizerWorker(tokenizer, lambda m: None, sent.extend, Preparation(tokenizer))
    worker.observe(TokenizerTimeline())
    params = SamplingParams(max_tokens=3, stop=["zz"])
    ids = tokenizer.encode("hello", add_special_tokens=False)
    scheduler_batch = TimelineMsg([Queued(1, "scheduler", 1.0)], [4], (1.0, 2, 0, 9))
    worker.handle(
        [TokenizeMsg(1, params, text="a"), TokenizeMsg(2, params, text="b"), scheduler_batch]
    )
    worker.handle([DetokenizeMsg(1, ids[0]), DetokenizeMsg(1, ids[0], finish_reason="length")])
    worker.handle([AbortMsg(2), BackendErrorMsg(3, ErrorInfo(ErrorKind.INTERNAL, "x"))])
    batches = [m for m in sent if isinstance(m, TimelineMsg)]
    events = [(e.uid, e.process, e.event) for b in batches for e in b.events]
    assert events == [
        (1, "tokenizer", "tokenized"),
        (2, "tokenizer", "tokenized"),
        (1, "scheduler", "queued"),
        (1, "tokenizer", "first_output"),
        (1, "tokenizer", "finished"),
        (2, "tokenizer", "aborted"),
    ]  # fmt: skip  (uid 3 had no state: its late error records nothing)
    assert batches[0].step_tokens == [4] and batches[0].kv == (1.0, 2, 0, 9)
    # each batch goes out after the replies it describes, in the same send
    assert isinstance(sent[sent.index(batches[1]) - 1], UserReply)


def test_the_tokenizer_worker_records_a_backend_error_with_its_kind(tmp_path):
    sent: list = []
    tokenizer = make_tokenizer(tmp_path)
    worker = TokenizerWorker(tokenizer, lambda m: None, sent.extend, Preparation(tokenizer))
    worker.observe(TokenizerTimeline())
    worker.handle([TokenizeMsg(3, SamplingParams(), text="a")])
    worker.handle([BackendErrorMsg(3, ErrorInfo(ErrorKind.INTERNAL, "x"))])
    events = [e for m in sent if isinstance(m, TimelineMsg) for e in m.events]
    assert [(e.event, e.detail()) for e in events] == [
        ("tokenized", {"prompt_tokens": events[0].prompt_tokens}),
        ("error", {"kind": "internal"}),
    ]


def test_a_tokenizer_worker_without_timelines_still_passes_the_schedulers_on(tmp_path):
    sent: list = []
    tokenizer = make_tokenizer(tmp_path)
    worker = TokenizerWorker(tokenizer, lambda m: None, sent.extend, Preparation(tokenizer))
    worker.handle([TokenizeMsg(1, SamplingParams(), text="a")])
    assert sent == []
    batch = TimelineMsg([Finished(1, "scheduler", 1.0)])
    worker.handle([batch])
    assert [m.events for m in sent] == [batch.events]


# ---------------------------------------------------------------- the frontend's end
@pytest.mark.parametrize(
    ("ending", "event", "detail"),
    [
        ("finished", "finished", {"reason": "stop"}),
        ("disconnect", "aborted", {"by": "client_disconnect"}),
        ("slow_client", "aborted", {"by": "slow_client"}),
        ("stall", "aborted", {"by": "stall"}),
        ("shutdown", "aborted", {"by": "shutdown"}),
        ("error", "error", {"code": "context_length_exceeded", "kind": "context_length_exceeded"}),
    ],
)
async def test_the_api_server_names_how_each_request_ended(ending, event, detail):
    backend = FakeBackend()
    store = Timelines(history=4)
    # "hi" fits under the slow-client cap, "a long text" does not
    frontend = FrontendManager(backend.send, backend.recv, max_pending_bytes=text_bytes("hi"))
    frontend.observe(ApiTimeline(store))

    async def serve():
        async with frontend.request(
            lambda uid: TokenizeMsg(uid, SamplingParams(), text="x")
        ) as state:
            async for out in frontend.wait_for_ack(state):
                if ending == "disconnect":
                    raise asyncio.CancelledError
                if ending == "stall":
                    state.stalled = True
                    raise asyncio.CancelledError
                if out.finished:
                    return

    async with listening(frontend):
        task = asyncio.create_task(serve())
        await wait_until(lambda: frontend.states)
        (state,) = frontend.states.values()
        if ending == "finished":
            reply = UserReply(state.uid, "hi", True, "stop", prompt_tokens=3, completion_tokens=1)
            backend.inject(reply)
        elif ending in ("disconnect", "stall"):
            backend.inject(UserReply(state.uid, "hi", prompt_tokens=3, completion_tokens=1))
        elif ending == "slow_client":
            backend.inject(
                UserReply(state.uid, "a long text", prompt_tokens=3, completion_tokens=1)
            )
        elif ending == "shutdown":
            end_all(frontend, ErrorInfo(ErrorKind.SHUTTING_DOWN, "bye"))  # a shutdown
        else:
            error = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "too long")
            backend.inject(UserReply(state.uid, finished=True, error=error))
        await asyncio.wait({task})
    (timeline,) = store.snapshot({})["ended"]
    end = timeline["events"][-1]
    assert (end["process"], end["event"]) == ("api", event)
    assert {k: end[k] for k in detail} == detail
    assert timeline["state"] == event


# ---------------------------------------------------------------- the step's phase marks
def test_a_step_marks_its_phases_in_the_observers_the_scheduler_hands_its_engine(engine):
    class Marks(SchedulerTimeline):
        def __init__(self) -> None:
            super().__init__()
            self.marks: list[str] = []

        def phase(self, name: str) -> None:
            self.marks.append(name)

    marks = Marks()
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=64))
    sched.observe(marks)
    assert engine.observer is sched.observer and marks in engine.observer.observers
    sched.process_msg(_user(1, 5, max_tokens=3, ignore_eos=True))
    sched.step()
    assert marks.marks == ["schedule", "post", "prepare", "forward", "prepare", "sample",
                           "post", "sample", "post"]  # fmt: skip
    Scheduler(engine)  # the engine's next scheduler: its marks go there, not here
    assert marks not in engine.observer.observers
