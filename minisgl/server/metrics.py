"""Prometheus metrics of the API server (`GET /metrics`).

Contract: one `ServerMetrics` per app, on its own registry (no global state). It is an
observer of the FrontendManager (minisgl/observe.py): it counts tokens as replies arrive,
and, when a request's scope closes, the `Outcome` the frontend decided with its error code;
requests refused before they reached the backend come as a "refused" event (and from the
middleware, `on_rejected`). The scheduler's share of each request's timeline (a
`TimelineMsg` in its inbox) gives the metrics vLLM exposes under the same names and
meanings: queue, prefill, decode and inference time of each finished request,
preemptions and the tokens of each step. Gauges of the workers (running, pending, KV
pages) are read at scrape time from the same state query that serves /debug/lifecycle.
`minisgl_engine_fallback{part}` is 1 for each part of the CUDA fast path the engine's
start-up self-check fell back from (`set_fallbacks`), 0 for the others.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minisgl.message import SchedulerState, UserReply
from minisgl.observe import Outcome, RequestObserver
from minisgl.timeline.events import SCHEDULER, Finished, Preempted, TimelineMsg

from .frontend import RequestState
from .middleware import arrival_var

# the parts of the CUDA fast path the engine's self-check can fall back from
# (engine/selfcheck.py): the Triton attention backend, the decode CUDA graphs, overlap
FALLBACK_PARTS = ("triton", "cuda_graph", "overlap")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for request-level times and for tokens per step
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics(RequestObserver):
    def __init__(self) -> None:
        # per request in flight: (arrival, scope opened, latest output token or None)
        self._live: dict[int, list[Any]] = {}
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "minisgl_requests", "Requests by outcome", ["outcome", "code"], registry=r
        )
        self.disconnects = Counter(
            "minisgl_client_disconnects", "Clients that disconnected mid-request", registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds",
            "From request admission to its first output token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds",
            "Time between consecutive output tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens in", registry=r)
        self.generation_tokens = Counter(
            "minisgl_generation_tokens", "Output tokens out", registry=r
        )
        self.in_flight = Gauge(
            "minisgl_requests_in_flight", "Requests the API server is serving", registry=r
        )
        self.running = Gauge("minisgl_requests_running", "Requests decoding", registry=r)
        self.pending = Gauge(
            "minisgl_requests_pending", "Requests waiting for or in prefill", registry=r
        )
        self.kv_pages_used = Gauge(
            "minisgl_kv_pages_used", "KV cache pages held by live requests", registry=r
        )
        self.kv_pages_total = Gauge("minisgl_kv_pages_total", "KV cache pages", registry=r)
        # the prefix cache, under the names vLLM gives the same figures
        self.kv_cache_usage = Gauge(
            "minisgl_kv_cache_usage_perc",
            "Fraction of KV cache pages held by live requests (cached-only pages are free)",
            registry=r,
        )
        self.kv_pages_cached = Gauge(
            "minisgl_kv_pages_cached", "KV cache pages held by the prefix cache alone", registry=r
        )
        self.prefix_queries = Counter(
            "minisgl_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "minisgl_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self._prefix_seen = (0, 0)  # the scheduler's running totals at the last scrape

        def request_time(name: str, what: str) -> Histogram:
            return Histogram(name, what, buckets=_REQUEST_BUCKETS, registry=r)

        self.e2e = request_time(
            "minisgl_e2e_request_latency_seconds",
            "Finished requests: from arrival at the API server to their end",
        )
        self.queue_time = request_time(
            "minisgl_request_queue_time_seconds",
            "Finished requests: time queued in the scheduler before their first prefill step",
        )
        self.prefill_time = request_time(
            "minisgl_request_prefill_time_seconds",
            "Finished requests: from their first prefill step to their first token",
        )
        self.decode_time = request_time(
            "minisgl_request_decode_time_seconds",
            "Finished requests: from their first token to their last",
        )
        self.inference_time = request_time(
            "minisgl_request_inference_time_seconds",
            "Finished requests: prefill time plus decode time",
        )
        self.preemptions = Counter(
            "minisgl_num_preemptions",
            "Sequences preempted (their KV pages taken back, recomputed later)",
            registry=r,
        )
        self.step_tokens = Histogram(
            "minisgl_iteration_tokens_total",
            "Tokens computed per scheduler step (prefill chunks plus decodes)",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )

        self.fallback = Gauge(
            "minisgl_engine_fallback",
            "1 where the engine's start-up self-check fell back from this part of the fast path",
            ["part"],
            registry=r,
        )

    def set_fallbacks(self, degraded: dict[str, str]) -> None:
        for part in (*FALLBACK_PARTS, *(p for p in degraded if p not in FALLBACK_PARTS)):
            self.fallback.labels(part).set(1 if part in degraded else 0)

    # ------------------------------------------------------------ the frontend's hooks
    def received(self, state: RequestState, /, **detail: Any) -> None:
        now = time.monotonic()
        arrival = arrival_var.get()
        self._live[state.uid] = [arrival[0] if arrival else now, now, None]

    def reply(self, state: RequestState, reply: UserReply, /) -> None:
        new_tokens = reply.completion_tokens - state.buffer.choices[reply.index].tokens
        if new_tokens <= 0:
            return
        live, now, gap = self._live[state.uid], time.monotonic(), None
        if live[2] is None:
            self.on_first_token(now - live[1], reply.prompt_tokens)
        else:
            gap = (now - live[2]) / new_tokens
        self.on_tokens(new_tokens, gap)
        live[2] = now

    def event(self, state: RequestState | None, name: str, /, **detail: Any) -> None:
        if name == "refused":
            self.on_rejected(detail["code"])
        elif name == "disconnected":
            self.on_disconnect()

    def ended(self, state: RequestState, outcome: Outcome, /, code: str = "", **detail) -> None:
        arrival = self._live.pop(state.uid)[0]
        self.on_request_end(outcome, code)
        if outcome is Outcome.FINISHED:
            self.on_finished(time.monotonic() - arrival)

    def inbox(self, msg: Any, /) -> bool:
        if not isinstance(msg, TimelineMsg):
            return False
        self.on_timeline(msg)
        return True

    # ------------------------------------------------------------ counts
    def on_first_token(self, ttft: float, prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int, gap: float | None) -> None:
        """`n` new output tokens; `gap`: seconds per token since the previous ones."""
        if gap is not None:
            for _ in range(n):
                self.itl.observe(gap)
        self.generation_tokens.inc(n)

    def on_request_end(self, outcome: Outcome, code: str = "") -> None:
        self.requests.labels(outcome.value, code).inc()

    def on_finished(self, e2e: float) -> None:
        self.e2e.observe(e2e)

    def on_timeline(self, msg: TimelineMsg) -> None:
        """What the scheduler's timeline batch says about finished requests and steps."""
        for tokens in msg.step_tokens:
            self.step_tokens.observe(tokens)
        for e in msg.events:
            if e.process != SCHEDULER:
                continue
            if isinstance(e, Preempted):
                self.preemptions.inc()
            elif isinstance(e, Finished) and e.timed:
                self.queue_time.observe(e.queue_s)
                self.prefill_time.observe(e.prefill_s)
                self.decode_time.observe(e.decode_s)
                self.inference_time.observe(e.prefill_s + e.decode_s)

    def on_rejected(self, code: str) -> None:
        self.requests.labels("error", code).inc()

    def on_disconnect(self) -> None:
        self.disconnects.inc()

    # ------------------------------------------------------------ scrape
    def render(self, in_flight: int, sched: SchedulerState | None) -> bytes:
        """The metrics' text; `sched`: the scheduler's answer to this scrape's state query
        (None: it did not answer, the workers' gauges keep their last values)."""
        self.in_flight.set(in_flight)
        if sched is not None:
            self.running.set(sched.running)
            self.pending.set(sched.pending)
            self.kv_pages_used.set(sched.kv_pages_used)
            self.kv_pages_total.set(sched.kv_pages_total)
            self.kv_cache_usage.set(sched.kv_pages_used / max(1, sched.kv_pages_total))
            self.kv_pages_cached.set(sched.kv_pages_cached)
            # the scheduler keeps totals; the counters advance by what is new since
            queries, hits = sched.prefix_cache_query_tokens, sched.prefix_cache_hit_tokens
            self.prefix_queries.inc(max(0, queries - self._prefix_seen[0]))
            self.prefix_hits.inc(max(0, hits - self._prefix_seen[1]))
            self._prefix_seen = (queries, hits)
        return generate_latest(self.registry)
