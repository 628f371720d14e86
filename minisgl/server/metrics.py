"""Prometheus metrics of the API server (`GET /metrics`).

Contract: one `ServerMetrics` per app, on its own registry (no global state). The frontend
calls `on_reply` for every reply it accepts (token timing), `on_request_end` when a
request's scope closes (its outcome), and the HTTP layer calls `on_rejected` for requests
refused before they reached the backend. Gauges of the workers (running, pending, KV pages)
are read at scrape time from the same state query that serves /debug/lifecycle.

Outcomes: finished, aborted_client (disconnect or early exit), aborted_slow_client (output
cap or stall), error (with the OpenAI error code).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minisgl.message import UserReply

if TYPE_CHECKING:
    from .frontend import RequestState

SLOW_CLIENT = "slow_client"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
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
        self.kv_pages_used = Gauge("minisgl_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_total = Gauge("minisgl_kv_pages_total", "KV cache pages", registry=r)

    # ------------------------------------------------------------ events
    def on_reply(self, state: RequestState, reply: UserReply) -> None:
        new_tokens = reply.completion_tokens - state.buffer.choices[reply.index].tokens
        if new_tokens <= 0:
            return
        now = time.monotonic()
        if state.last_token_at is None:
            self.ttft.observe(now - state.created_at)
            self.prompt_tokens.inc(reply.prompt_tokens)
        else:
            gap = (now - state.last_token_at) / new_tokens
            for _ in range(new_tokens):
                self.itl.observe(gap)
        state.last_token_at = now
        self.generation_tokens.inc(new_tokens)

    def on_request_end(self, state: RequestState) -> None:
        buffer = state.buffer
        if buffer.error is not None:
            code = buffer.error.code or "error"
            outcome = "aborted_slow_client" if code == SLOW_CLIENT else "error"
            self.requests.labels(outcome, code if outcome == "error" else "").inc()
        elif buffer.finished:
            self.requests.labels("finished", "").inc()
        elif state.stalled:
            self.requests.labels("aborted_slow_client", "").inc()
        else:
            self.requests.labels("aborted_client", "").inc()

    def on_rejected(self, code: str) -> None:
        self.requests.labels("error", code).inc()

    def on_disconnect(self) -> None:
        self.disconnects.inc()

    # ------------------------------------------------------------ scrape
    def render(self, in_flight: int, lifecycle: dict[str, dict[str, int]] | None) -> bytes:
        self.in_flight.set(in_flight)
        if lifecycle is not None:
            sched = lifecycle["scheduler"]
            self.running.set(sched["running"])
            self.pending.set(sched["pending"])
            self.kv_pages_used.set(sched["kv_pages_used"])
            self.kv_pages_total.set(sched["kv_pages_total"])
        return generate_latest(self.registry)
