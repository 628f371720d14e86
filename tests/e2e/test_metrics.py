"""Prometheus metrics of the real server (tiny Llama, 32k context): finished requests add
their prompt and generated tokens and one time-to-first-token and inter-token gaps to the
latency histograms; every request is counted once by outcome (finished, aborted by the
client, error with its code); the in-flight, running, pending and KV-page gauges follow the
load and return to zero. (The 401 and 413 refusals: test_auth.py, test_body_limit.py.)"""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import (
    CHAT_PATH,
    CONTEXT_32K,
    ENDLESS,
    LIMITS_SERVER,
    assert_completed_stream,
    assert_error_body,
    changed,
    chat_body,
    chat_url,
    metric,
    n_running,
    raw_post,
    request_counts,
    scrape_metrics,
    tokens_body,
    wait_state,
)

pytestmark = pytest.mark.server(LIMITS_SERVER)


def test_metrics_count_tokens_and_latencies_of_finished_requests(server):
    url = chat_url(server)
    before = scrape_metrics(server)
    with httpx.Client(timeout=60) as http:
        usages = []
        for n in (4, 9):
            r = http.post(url, json=tokens_body(server, n, content="hello"))
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        body = tokens_body(server, 7, stream=True, content="hello")
        with http.stream("POST", url, json=body) as r:
            assert_completed_stream(r.read())  # ignore_eos + "length": exactly 7 tokens
        usages.append({"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": 7})
    server.wait_zero(1.0)
    after = scrape_metrics(server)

    def grown(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grown("minisgl_requests_total", code="", outcome="finished") == 3
    gen = sum(u["completion_tokens"] for u in usages)
    assert grown("minisgl_generation_tokens_total") == gen
    assert grown("minisgl_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    ttft = "minisgl_time_to_first_token_seconds_count"
    itl = "minisgl_inter_token_latency_seconds_count"
    assert grown(ttft) == 3  # one first token per request
    # each token after a request's first reply is one inter-token gap observed
    assert 0 < grown(itl) <= gen - 3
    for name in (ttft, itl):
        base = name[: -len("_count")]
        assert after[(base + "_bucket", (("le", "+Inf"),))] == after[(name, ())]
        assert after[(base + "_sum", ())] > before.get((base + "_sum", ()), 0.0)


def test_metrics_count_each_outcome_and_the_gauges_follow_the_load(server):
    url = chat_url(server)
    before = scrape_metrics(server)
    with httpx.Client(timeout=60) as http:
        # finished: two non-streaming, one streaming
        for stream in (False, False, True):
            r = http.post(url, json=tokens_body(server, 3, stream=stream))
            assert r.status_code == 200, r.text

        # a client that disconnects mid-stream; while it runs, the gauges show it
        with http.stream("POST", url, json=tokens_body(server, ENDLESS, stream=True)) as r:
            assert r.status_code == 200
            parts = r.iter_raw()  # held: dropping the iterator would close the stream
            next(parts)
            wait_state(server, n_running(1))
            live = scrape_metrics(server)
        # a client that disconnects before its non-streaming answer
        sock = raw_post(server.port, CHAT_PATH, tokens_body(server, ENDLESS))
        try:
            wait_state(server, n_running(1))
        finally:
            sock.close()
        server.wait_zero(1.0)

        # errors, each with its code
        errors = [
            (chat_body("no-such-model"), 404, "model_not_found"),
            ({**tokens_body(server, 4), "max_tokens": 0}, 400, "invalid_value"),
            (
                chat_body(server.model_name, "x" * (CONTEXT_32K + 100)),
                400,
                "context_length_exceeded",
            ),
        ]
        for body, status, code in errors:
            r = http.post(url, json=body)
            assert r.status_code == status, r.text
            assert_error_body(r.json(), code)
    server.wait_zero(1.0)
    after = scrape_metrics(server)

    assert changed(request_counts(after), request_counts(before)) == {
        ("finished", ""): 3,
        ("aborted_client", ""): 2,
        ("error", "model_not_found"): 1,
        ("error", "invalid_value"): 1,
        ("error", "context_length_exceeded"): 1,
    }
    disconnects = "minisgl_client_disconnects_total"
    assert metric(after, disconnects) - metric(before, disconnects) == 2

    lifecycle = server.lifecycle()["scheduler"]
    total = lifecycle["kv_pages_total"]
    assert total > 0
    assert metric(live, "minisgl_requests_in_flight") == 1
    assert metric(live, "minisgl_requests_running") == 1
    assert metric(live, "minisgl_requests_pending") == 0
    assert 0 < metric(live, "minisgl_kv_pages_used") <= total
    assert metric(live, "minisgl_kv_pages_total") == total
    for name in (
        "minisgl_requests_in_flight",
        "minisgl_requests_running",
        "minisgl_requests_pending",
        "minisgl_kv_pages_used",
    ):
        assert metric(after, name) == 0, name
    assert metric(after, "minisgl_kv_pages_total") == total
