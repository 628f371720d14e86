"""Request timelines over the real server (tiny model, 16 KB per token, an API key and a
one-second stall timeout): after a normal request, a disconnect mid-stream, a
non-streaming disconnect, an over-long prompt and a client that reads nothing,
GET /debug/requests shows each, found by its X-Request-Id, with the right end in each
process it reached and nothing recorded after an end; /debug/lifecycle is back at zero;
the timelines, the live page and the new metrics; the debug routes need the key (the
page also takes it as HTTP Basic auth, which a browser asks for)."""

from __future__ import annotations

import base64
import time

import httpx
import pytest
from e2e_helpers import (
    AUTH,
    CHAT_PATH,
    KEY_SERVER,
    STALL_S,
    chat_body,
    chat_url,
    metric,
    raw_post,
    read_until_closed,
    scrape_metrics,
    tokens_body,
)

from minisgl.timeline.events import END_EVENTS

pytestmark = pytest.mark.server(KEY_SERVER)


def _headers(request_id: str) -> dict[str, str]:
    return {**AUTH, "X-Request-Id": request_id}


def _requests(server, **params) -> dict:
    r = httpx.get(server.base_url + "/debug/requests", params=params, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _ended(server, request_id: str, processes: set[str], timeout: float = 10.0) -> dict:
    """The ended timeline of `request_id`, once each of `processes` has recorded its end."""
    deadline = time.monotonic() + timeout
    while True:
        found = _requests(server, request_id=request_id)["ended"]
        if found:
            ends = {e["process"] for e in found[0]["events"] if e["event"] in END_EVENTS}
            if processes <= ends:
                return found[0]
        assert time.monotonic() < deadline, (request_id, found)
        time.sleep(0.1)


def _end(timeline: dict, process: str) -> dict:
    (end,) = [e for e in timeline["events"] if e["process"] == process and e["event"] in END_EVENTS]
    return end


def assert_consistent(timeline: dict) -> None:
    """Ordered in time; per process, one end and it is that process's last event; the
    request moves through the processes in order."""
    times = [e["t"] for e in timeline["events"]]
    assert times == sorted(times) and times[0] == 0.0
    for process in {e["process"] for e in timeline["events"]}:
        own = [e for e in timeline["events"] if e["process"] == process]
        ends = [e for e in own if e["event"] in END_EVENTS]
        assert len(ends) <= 1 and (not ends or own[-1] is ends[0]), (process, own)
        assert all(e.get("t_end", e["t"]) <= ends[0]["t"] + 1e-3 for e in own) if ends else True
    first = {e["process"]: e["t"] for e in reversed(timeline["events"])}
    assert first["api"] <= first.get("tokenizer", 1e9) <= first.get("scheduler", 1e9)


def test_each_way_of_ending_shows_in_its_timeline(server):
    started = time.monotonic()
    # a normal request
    body = chat_body(server.model_name, max_tokens=4, ignore_eos=True)
    assert httpx.post(chat_url(server), json=body, headers=_headers("tl-normal")).status_code == 200
    # a disconnect mid-stream
    with httpx.stream(
        "POST", chat_url(server), json=tokens_body(server, 2000, stream=True),
        headers=_headers("tl-stream-gone"), timeout=30,
    ) as r:  # fmt: skip
        next(r.iter_raw())
    # a non-streaming disconnect
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            chat_url(server), json=tokens_body(server, 2000), headers=_headers("tl-full-gone"),
            timeout=0.5,
        )  # fmt: skip
    # a prompt longer than the context
    long = chat_body(server.model_name, "word " * 5000, max_tokens=2)
    r = httpx.post(chat_url(server), json=long, headers=_headers("tl-too-long"), timeout=30)
    assert r.status_code == 400
    # a client that reads nothing: aborted by the stall sweeper
    sock = raw_post(
        server.port, CHAT_PATH, tokens_body(server, 4000, stream=True), rcvbuf=4096,
        headers=_headers("tl-stalled"),
    )  # fmt: skip
    try:
        stalled = _ended(server, "tl-stalled", {"api", "tokenizer", "scheduler"}, STALL_S + 30)
        read_until_closed(sock, bytearray(), ends=(ConnectionResetError, TimeoutError))
    finally:
        sock.close()

    everyone = {"api", "tokenizer", "scheduler"}
    normal = _ended(server, "tl-normal", everyone)
    assert _end(normal, "api") == {**_end(normal, "api"), "event": "finished", "reason": "length"}
    assert _end(normal, "scheduler")["event"] == "finished"
    assert _end(normal, "tokenizer")["event"] == "finished"
    names = [e["event"] for e in normal["events"] if e["process"] == "scheduler"]
    assert names[:2] == ["queued", "prefill"] and "first_token" in names and "decode" in names
    assert (normal["prompt_tokens"], normal["output_tokens"]) >= (1, 4)

    for request_id in ("tl-stream-gone", "tl-full-gone"):
        gone = _ended(server, request_id, everyone)
        assert _end(gone, "api")["by"] == "client_disconnect"
        assert _end(gone, "tokenizer")["event"] == _end(gone, "scheduler")["event"] == "aborted"
        assert _end(gone, "api")["t"] <= _end(gone, "tokenizer")["t"]  # the API server first

    too_long = _ended(server, "tl-too-long", everyone)
    assert _end(too_long, "api")["code"] == "context_length_exceeded"
    assert [e["event"] for e in too_long["events"] if e["process"] == "scheduler"] == [
        "queued", "error"
    ]  # fmt: skip

    assert _end(stalled, "api") == {**_end(stalled, "api"), "event": "aborted", "by": "stall"}
    assert _end(stalled, "scheduler")["event"] == "aborted"

    for timeline in (normal, stalled, too_long, *(_ended(server, i, everyone) for i in ("tl-stream-gone", "tl-full-gone"))):  # fmt: skip
        assert_consistent(timeline)
        assert timeline["endpoint"] == CHAT_PATH
    snapshot = _requests(server)
    assert snapshot["late_events"] == 0 and snapshot["in_flight"] == []
    assert snapshot["kv_pages"] and snapshot["kv_pages"][-1][3] > 0
    assert time.monotonic() - started < 120
    server.wait_zero(5.0)

    # the metrics operators know from vLLM
    text = scrape_metrics(server)
    assert metric(text, "minisgl_e2e_request_latency_seconds_count") >= 1
    assert metric(text, "minisgl_request_queue_time_seconds_count") >= 1
    assert metric(text, "minisgl_request_decode_time_seconds_count") >= 1
    assert metric(text, "minisgl_iteration_tokens_total_count") >= 5
    assert metric(text, "minisgl_num_preemptions_total") == 0


def test_the_debug_routes_need_the_key(server):
    base = server.base_url
    for path in ("/debug/requests", "/debug"):
        r = httpx.get(base + path, timeout=10)
        assert r.status_code == 401, (path, r.text)
    assert "Basic" in httpx.get(base + "/debug").headers["www-authenticate"]
    basic = (
        "Basic " + base64.b64encode(b"anyone:" + AUTH["authorization"].split()[1].encode()).decode()
    )
    wrong = "Basic " + base64.b64encode(b"anyone:wrong").decode()
    assert httpx.get(base + "/debug", headers={"authorization": wrong}).status_code == 401
    page = httpx.get(base + "/debug", headers={"authorization": basic})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/debug/requests" in page.text and "<script>" in page.text
    assert "src=" not in page.text and "<link" not in page.text  # nothing from elsewhere
    assert httpx.get(base + "/debug/requests", headers={"authorization": basic}).status_code == 200
    assert httpx.get(base + "/debug/requests", headers=AUTH).status_code == 200


def test_one_answer_is_bounded_however_long_the_history(server):
    with httpx.Client(headers=AUTH, timeout=30) as http:
        for _ in range(120):
            body = tokens_body(server, 1)
            assert http.post(chat_url(server), json=body).status_code == 200
        first = _requests(server)  # the default: at most 100 of each
        assert len(first["ended"]) == 100 and first["ended_total"] >= 120
        newest = first["ended_total"]
        assert http.post(chat_url(server), json=tokens_body(server, 1)).status_code == 200
        time.sleep(0.2)
        new = _requests(server, since=newest)["ended"]  # what a poller asks next
        assert [t["seq"] for t in new] == [newest + 1]
        assert len(_requests(server, limit=7)["ended"]) == 7
        for bad in ({"limit": 0}, {"limit": 100_000}, {"since": -1}):
            r = http.get(server.base_url + "/debug/requests", params=bad)
            assert r.status_code == 400, (bad, r.text)
