"""Operations on the real three-process server (tiny Llama): admission control (503 with
Retry-After past --max-concurrent-requests), the request body limit (413, declared or
chunked), the API key (401 on /v1/*), X-Request-Id on every answer and in the log lines
about its request, Prometheus metrics, the drain on SIGTERM (and SIGINT), and a tokenizer
worker killed with SIGKILL. Wherever the server survives, /debug/lifecycle ends at zero.

Long requests run on a 32k-token context: a stream of 30,000 tokens takes minutes on the
tiny model, so it stays in flight until the test closes it (or the server drains it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import (
    SSE_DONE,
    assert_error_body,
    chat_body,
    raw_post,
    scrape_metrics,
    split_sse,
    start_server,
)
from minisgl.testing.server import (
    RunningServer,
    assert_all_gone,
    inbox_owner,
    ipc_dir,
)

PATH = "/v1/chat/completions"
CONTEXT = 32768
LONG = 30_000  # tokens: minutes of decoding, never finishes within a test
MAX_BODY = 65536
API_KEY = "test-key-0123456789"
GENERATED_ID = re.compile(r"^[A-Za-z0-9._:\-]{8,128}$")


@pytest.fixture(scope="module")
def long_dir(tiny_dirs, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("ops") / "ctx32k"
    shutil.copytree(tiny_dirs["llama"], dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def server(long_dir):
    s = start_server(
        long_dir,
        "--max-seq-len",
        str(CONTEXT),
        "--max-concurrent-requests",
        "2",
        "--max-body-bytes",
        str(MAX_BODY),
    )
    yield s
    s.stop()


def _url(server: RunningServer) -> str:
    return server.base_url + PATH


def _long_body(server: RunningServer, stream: bool) -> dict:
    return chat_body(server.model_name, max_tokens=LONG, ignore_eos=True, stream=stream)


def _short_body(server: RunningServer, n: int = 4, stream: bool = False) -> dict:
    return chat_body(server.model_name, max_tokens=n, ignore_eos=True, stream=stream)


def _wait_state(server: RunningServer, check, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not check(state := server.lifecycle()):
        assert time.monotonic() < deadline, f"state never reached: {state}"
        time.sleep(0.02)
    return state


def _assert_completed_stream(raw: bytes) -> list[dict]:
    """A stream that ended normally: chunks, one finish_reason chunk, one [DONE]."""
    assert raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1, raw[-300:]
    chunks = [json.loads(p) for p in split_sse(raw)[:-1]]
    assert all(c.get("object") == "chat.completion.chunk" for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    return chunks


def _assert_error_event_then_done(raw: bytes, code: str) -> None:
    """A stream that began and then ended with `data: {"error": ...}` and `data: [DONE]`."""
    assert raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1, raw[-300:]
    payloads = split_sse(raw)
    assert_error_body(json.loads(payloads[-2]), code)
    assert b'"finish_reason":"length"' not in raw


class _Stream:
    """A streaming request held open: headers in, the body read on demand."""

    def __init__(self, http: httpx.AsyncClient, url: str, body: dict, **kw) -> None:
        self._cm = http.stream("POST", url, json=body, **kw)
        self.raw = b""
        self.ended_at: float | None = None

    async def __aenter__(self) -> _Stream:
        self.response = await self._cm.__aenter__()
        self._parts = self.response.aiter_raw()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._cm.__aexit__(*exc)

    async def first(self) -> bytes:
        part = await anext(self._parts)
        self.raw += part
        return part

    async def rest(self) -> bytes:
        try:
            async for part in self._parts:
                self.raw += part
        except httpx.RemoteProtocolError:  # cut mid-stream: also an end
            pass
        self.ended_at = time.monotonic()
        return self.raw


# ---------------------------------------------------------------- admission
async def test_requests_past_the_concurrency_limit_get_503_with_retry_after_at_once(server):
    url = _url(server)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as http:
        # one stream that will finish on its own, one that only the client ends
        finishing = _Stream(http, url, _short_body(server, 3000, stream=True))
        held = _Stream(http, url, _long_body(server, stream=True))
        async with finishing, held:
            assert finishing.response.status_code == held.response.status_code == 200
            await finishing.first()
            await held.first()
            assert server.lifecycle()["frontend"]["requests"] == 2

            async def refused(stream: bool) -> tuple[httpx.Response, float]:
                start = time.monotonic()
                r = await http.post(url, json=_short_body(server, stream=stream))
                return r, time.monotonic() - start

            burst = await asyncio.gather(*(refused(i % 2 == 1) for i in range(8)))
            for r, took in burst:
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "overloaded")
                assert r.json()["error"]["type"] == "server_error"
                assert int(r.headers["retry-after"]) >= 1
                assert GENERATED_ID.match(r.headers["x-request-id"])
                # a queued request would wait minutes for the held stream
                assert took < 5.0
            # nothing queued behind the two, and a busy server is still healthy
            assert server.lifecycle()["frontend"]["requests"] == 2
            assert (await http.get(server.base_url + "/health")).status_code == 200

            _assert_completed_stream(await finishing.rest())
            # one slot free again: a request is served while the held stream runs on
            r = await http.post(url, json=_short_body(server))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        # leaving the block closed the held stream: both slots free
        server.wait_zero(2.0)
        again = await asyncio.gather(*(http.post(url, json=_short_body(server)) for _ in range(2)))
        assert [r.status_code for r in again] == [200, 200]
    server.wait_zero(1.0)


# ---------------------------------------------------------------- body limit
def _padded(body: dict, size: int) -> bytes:
    """`body` as JSON, padded with insignificant whitespace to exactly `size` bytes."""
    data = json.dumps(body).encode()
    assert len(data) < size
    return data[:-1] + b" " * (size - len(data)) + b"}"


def _chunks(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(server):
    body = _short_body(server)
    with httpx.Client(timeout=30) as http:
        ok = http.post(
            _url(server),
            content=_padded(body, MAX_BODY),
            headers={"content-type": "application/json"},
        )
        assert ok.status_code == 200, ok.text
        over = http.post(
            _url(server),
            content=_padded(body, MAX_BODY + 1),
            headers={"content-type": "application/json", "x-request-id": "too-big-1"},
        )
    assert over.status_code == 413, over.text
    assert_error_body(over.json(), "body_too_large")
    assert over.headers["x-request-id"] == "too-big-1"
    server.wait_zero(1.0)


def test_chunked_body_over_the_limit_is_413_and_under_it_is_served(server):
    body = _short_body(server)
    with httpx.Client(timeout=30) as http:
        # a generator has no length: httpx sends it with Transfer-Encoding: chunked
        ok = http.post(
            _url(server),
            content=_chunks(_padded(body, MAX_BODY - 100), 4096),
            headers={"content-type": "application/json"},
        )
        assert ok.request.headers.get("transfer-encoding") == "chunked"
        assert ok.status_code == 200, ok.text
        over = http.post(
            _url(server),
            content=_chunks(_padded(body, MAX_BODY + 16 * 1024)),
            headers={"content-type": "application/json", "x-request-id": "too-big-chunked"},
        )
    assert over.request.headers.get("transfer-encoding") == "chunked"
    assert over.status_code == 413, over.text
    assert_error_body(over.json(), "body_too_large")
    assert over.headers["x-request-id"] == "too-big-chunked"
    server.wait_zero(1.0)


# ---------------------------------------------------------------- X-Request-Id
def _chat(**params):
    return lambda model: chat_body(model, max_tokens=4, ignore_eos=True, **params)


# name -> (method, path, body from the model name (dict, raw bytes or None), status)
ID_CASES = {
    "chat_200": ("POST", PATH, _chat(), 200),
    "chat_stream_200": ("POST", PATH, _chat(stream=True), 200),
    "malformed_json_400": ("POST", PATH, lambda model: b'{"model": ', 400),
    "bad_param_400": ("POST", PATH, _chat(top_p=0), 400),
    "unknown_model_404": ("POST", PATH, lambda model: chat_body("no-such-model"), 404),
    "unknown_route_404": ("GET", "/v1/nothing-here", lambda model: None, 404),
    "wrong_method_405": ("GET", PATH, lambda model: None, 405),
    "models_200": ("GET", "/v1/models", lambda model: None, 200),
    "health_200": ("GET", "/health", lambda model: None, 200),
    "metrics_200": ("GET", "/metrics", lambda model: None, 200),
    "lifecycle_200": ("GET", "/debug/lifecycle", lambda model: None, 200),
}


@pytest.mark.parametrize("case", list(ID_CASES))
def test_x_request_id_is_echoed_or_generated_on_every_answer(server, case):
    method, path, make_body, status = ID_CASES[case]
    body = make_body(server.model_name)

    def send(headers: dict[str, str]) -> httpx.Response:
        kw: dict = {"headers": {"content-type": "application/json", **headers}}
        if isinstance(body, bytes):
            kw["content"] = body
        elif body is not None:
            kw["json"] = body
        r = httpx.request(method, server.base_url + path, timeout=30, **kw)
        assert r.status_code == status, r.text
        if status >= 400:
            assert_error_body(r.json())
        return r

    assert send({"x-request-id": "client-chose-this.42"}).headers["x-request-id"] == (
        "client-chose-this.42"
    )
    generated = [send({}).headers["x-request-id"] for _ in range(2)]
    assert all(GENERATED_ID.match(g) for g in generated), generated
    assert generated[0] != generated[1]
    # an id that cannot go into a log line or a header as is: replaced, never echoed
    replaced = send({"x-request-id": "x" * 300}).headers["x-request-id"]
    assert GENERATED_ID.match(replaced) and replaced != "x" * 300
    server.wait_zero(1.0)


# ---------------------------------------------------------------- metrics
def _requests(m: dict, outcome: str, code: str = "") -> float:
    return m.get(("minisgl_requests_total", (("code", code), ("outcome", outcome))), 0.0)


def _value(m: dict, name: str) -> float:
    return m.get((name, ()), 0.0)


def _request_counts(m: dict) -> dict[tuple[str, str], float]:
    out = {}
    for (name, labels), value in m.items():
        if name == "minisgl_requests_total":
            d = dict(labels)
            out[(d["outcome"], d["code"])] = value
    return out


def _delta(after: dict, before: dict) -> dict:
    keys = set(after) | set(before)
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys if after.get(k) != before.get(k)
    }


def test_metrics_count_tokens_and_latencies_of_finished_requests(server):
    url = _url(server)
    before = scrape_metrics(server.base_url)
    with httpx.Client(timeout=60) as http:
        usages = []
        for n in (4, 9):
            r = http.post(
                url, json=chat_body(server.model_name, "hello", max_tokens=n, ignore_eos=True)
            )
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        body = chat_body(server.model_name, "hello", max_tokens=7, ignore_eos=True, stream=True)
        with http.stream("POST", url, json=body) as r:
            _assert_completed_stream(r.read())  # ignore_eos + "length": exactly 7 tokens
        usages.append({"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": 7})
    server.wait_zero(1.0)
    after = scrape_metrics(server.base_url)

    assert _requests(after, "finished") - _requests(before, "finished") == 3
    gen = sum(u["completion_tokens"] for u in usages)
    assert (
        _value(after, "minisgl_generation_tokens_total")
        - _value(before, "minisgl_generation_tokens_total")
        == gen
    )
    assert _value(after, "minisgl_prompt_tokens_total") - _value(
        before, "minisgl_prompt_tokens_total"
    ) == sum(u["prompt_tokens"] for u in usages)
    ttft = "minisgl_time_to_first_token_seconds_count"
    itl = "minisgl_inter_token_latency_seconds_count"
    assert _value(after, ttft) - _value(before, ttft) == 3  # one first token per request
    # each token after a request's first reply is one inter-token gap observed
    grown = _value(after, itl) - _value(before, itl)
    assert 0 < grown <= gen - 3
    for name in (ttft, itl):
        base = name[: -len("_count")]
        assert after[(base + "_bucket", (("le", "+Inf"),))] == after[(name, ())]
        assert after[(base + "_sum", ())] > before.get((base + "_sum", ()), 0.0)


def test_metrics_count_each_outcome_and_the_gauges_follow_the_load(server):
    url = _url(server)
    before = scrape_metrics(server.base_url)
    with httpx.Client(timeout=60) as http:
        # finished: two non-streaming, one streaming
        for stream in (False, False, True):
            r = http.post(url, json=_short_body(server, 3, stream=stream))
            assert r.status_code == 200, r.text

        # a client that disconnects mid-stream; while it runs, the gauges show it
        with http.stream("POST", url, json=_long_body(server, stream=True)) as r:
            assert r.status_code == 200
            parts = r.iter_raw()  # held: dropping the iterator would close the stream
            next(parts)
            _wait_state(server, lambda s: s["scheduler"]["running"] == 1)
            live = scrape_metrics(server.base_url)
        # a client that disconnects before its non-streaming answer
        sock = raw_post(server.port, PATH, _long_body(server, stream=False))
        try:
            _wait_state(server, lambda s: s["scheduler"]["running"] == 1)
        finally:
            sock.close()
        server.wait_zero(1.0)

        # errors, each with its code
        errors = [
            (chat_body("no-such-model"), 404, "model_not_found"),
            ({**_short_body(server), "max_tokens": 0}, 400, "invalid_value"),
            (chat_body(server.model_name, "x" * (CONTEXT + 100)), 400, "context_length_exceeded"),
        ]
        for body, status, code in errors:
            r = http.post(url, json=body)
            assert r.status_code == status, r.text
            assert_error_body(r.json(), code)
    server.wait_zero(1.0)
    after = scrape_metrics(server.base_url)

    assert _delta(_request_counts(after), _request_counts(before)) == {
        ("finished", ""): 3,
        ("aborted_client", ""): 2,
        ("error", "model_not_found"): 1,
        ("error", "invalid_value"): 1,
        ("error", "context_length_exceeded"): 1,
    }
    disconnects = "minisgl_client_disconnects_total"
    assert _value(after, disconnects) - _value(before, disconnects) == 2

    lifecycle = server.lifecycle()["scheduler"]
    total = lifecycle["kv_pages_total"]
    assert total > 0
    assert _value(live, "minisgl_requests_in_flight") == 1
    assert _value(live, "minisgl_requests_running") == 1
    assert _value(live, "minisgl_requests_pending") == 0
    assert 0 < _value(live, "minisgl_kv_pages_used") <= total
    assert _value(live, "minisgl_kv_pages_total") == total
    for name in (
        "minisgl_requests_in_flight",
        "minisgl_requests_running",
        "minisgl_requests_pending",
        "minisgl_kv_pages_used",
    ):
        assert _value(after, name) == 0, name
    assert _value(after, "minisgl_kv_pages_total") == total


def test_413_answers_are_counted_as_errors(server):
    """Refused before any route ran, with a declared length or a chunked body alike: each
    is one request that ended with the error body_too_large."""
    body = _short_body(server)
    before = scrape_metrics(server.base_url)
    with httpx.Client(timeout=30) as http:
        for content in (_padded(body, MAX_BODY + 1), _chunks(_padded(body, MAX_BODY + 16384))):
            r = http.post(
                _url(server), content=content, headers={"content-type": "application/json"}
            )
            assert r.status_code == 413
    after = scrape_metrics(server.base_url)
    assert _delta(_request_counts(after), _request_counts(before)) == {
        ("error", "body_too_large"): 2
    }


# ---------------------------------------------------------------- API key, stall log line
STALL_S = 1.0


@pytest.fixture(scope="module")
def key_server(long_token_dir):
    """The `long_token_dir` model (16 KB of text per token) fills socket buffers fast, so a
    client that reads nothing stalls within a second."""
    s = start_server(
        long_token_dir,
        "--max-seq-len",
        "4096",
        "--api-key",
        API_KEY,
        "--client-stall-timeout",
        str(STALL_S),
        "--max-pending-bytes",
        str(256 << 20),  # only the stall timeout ends a stalled stream here
    )
    yield s
    s.stop()


AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer wrong-key", f"Bearer {API_KEY}x", API_KEY, f"Basic {API_KEY}", "Bearer"],
    ids=["missing", "wrong", "longer", "no_scheme", "basic", "empty"],
)
def test_v1_routes_without_the_right_bearer_key_get_401(key_server, auth):
    headers = {"x-request-id": "auth-probe"}
    if auth is not None:
        headers["authorization"] = auth
    body = chat_body(key_server.model_name, max_tokens=1)
    requests = [
        ("GET", "/v1/models", None),
        ("POST", PATH, body),
        ("POST", PATH, {**body, "stream": True}),
        ("POST", PATH, b"not json at all"),  # refused before the body is even parsed
        ("GET", "/v1/no-such-route", None),
    ]
    for method, path, payload in requests:
        kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        r = httpx.request(method, key_server.base_url + path, headers=headers, timeout=30, **kw)
        assert r.status_code == 401, (path, r.text)
        assert_error_body(r.json(), "invalid_api_key")
        assert r.headers["x-request-id"] == "auth-probe"
        assert "invalid_api_key" in r.text and API_KEY not in r.text
    key_server.wait_zero(1.0)


def test_the_right_bearer_key_is_served_and_other_routes_stay_open(key_server):
    base = key_server.base_url
    body = chat_body(key_server.model_name, max_tokens=2, ignore_eos=True)
    r = httpx.post(base + PATH, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    with httpx.stream("POST", base + PATH, json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        _assert_completed_stream(r.read())
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/metrics", "/debug/lifecycle"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    key_server.wait_zero(1.0)


def test_401_answers_are_counted_as_errors(key_server):
    before = scrape_metrics(key_server.base_url)
    for _ in range(3):
        r = httpx.post(
            key_server.base_url + PATH, json=chat_body(key_server.model_name), timeout=30
        )
        assert r.status_code == 401
    after = scrape_metrics(key_server.base_url)
    assert _delta(_request_counts(after), _request_counts(before)) == {
        ("error", "invalid_api_key"): 3
    }


def _read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return bytes(data)


def test_stall_warning_names_the_request_id(key_server):
    before = scrape_metrics(key_server.base_url)
    request_id = "stall-probe-7"
    body = chat_body(key_server.model_name, stream=True, max_tokens=4000, ignore_eos=True)
    sock = raw_post(
        key_server.port, PATH, body, rcvbuf=4096, headers={**AUTH, "X-Request-Id": request_id}
    )
    try:
        deadline = time.monotonic() + 60
        while not any("read nothing" in line for line in key_server.log().splitlines()):
            assert time.monotonic() < deadline, key_server.log()[-3000:]
            time.sleep(0.05)
        key_server.wait_zero(STALL_S + 2.0)
        received = _read_all(sock)
    finally:
        sock.close()
    warnings = [line for line in key_server.log().splitlines() if "read nothing" in line]
    assert len(warnings) == 1 and request_id in warnings[0], warnings
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert f"x-request-id: {request_id}".encode() in head, head
    after = scrape_metrics(key_server.base_url)
    assert _delta(_request_counts(after), _request_counts(before)) == {
        ("aborted_slow_client", ""): 1
    }


def test_api_key_from_the_environment(tiny_dirs):
    s = RunningServer(str(tiny_dirs["llama"]), env={"MINISGL_API_KEY": API_KEY})
    try:
        assert httpx.get(s.base_url + "/v1/models", timeout=10).status_code == 401
        r = httpx.get(s.base_url + "/v1/models", headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == s.model_name
        assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------- drain on SIGTERM / SIGINT
SHUTDOWN_S = 3.0
SHORT = 150  # tokens: done well within SHUTDOWN_S, yet in flight when the signal comes


async def test_sigterm_drains_in_flight_requests_then_exits_0(long_dir):
    server = start_server(
        long_dir, "--max-seq-len", str(CONTEXT), "--shutdown-timeout", str(SHUTDOWN_S)
    )
    url = _url(server)
    try:
        ipc = ipc_dir(server)
        limits = httpx.Limits(max_connections=16)
        async with (
            httpx.AsyncClient(timeout=60, limits=limits) as http,
            httpx.AsyncClient(timeout=10) as probe,
        ):
            assert (await probe.get(server.base_url + "/health")).status_code == 200  # keep-alive
            longs = [_Stream(http, url, _long_body(server, stream=True)) for _ in range(2)]
            short = _Stream(http, url, _short_body(server, SHORT, stream=True))
            async with contextlib.AsyncExitStack() as stack:
                for s in longs:
                    await stack.enter_async_context(s)
                    await s.first()
                long_full = asyncio.create_task(http.post(url, json=_long_body(server, False)))
                await asyncio.to_thread(
                    _wait_state, server, lambda st: st["scheduler"]["running"] == 3
                )
                # the short ones last a fraction of a second: signal as soon as they run
                short_full = asyncio.create_task(http.post(url, json=_short_body(server, SHORT)))
                await stack.enter_async_context(short)
                await short.first()

                server.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                # as soon as the signal is handled, /health answers 503 ...
                while (health := await probe.get(server.base_url + "/health")).status_code == 200:
                    assert time.monotonic() - signalled < 1.0, "SIGTERM not handled"
                    await asyncio.sleep(0.01)
                assert health.status_code == 503
                assert_error_body(health.json(), "shutting_down")
                # ... and new work is refused, on an open connection and on a new one
                for client in (probe, http):
                    r = await client.post(
                        url, json=_short_body(server), headers={"x-request-id": "late-1"}
                    )
                    assert r.status_code == 503, r.text
                    assert_error_body(r.json(), "shutting_down")
                    assert int(r.headers["retry-after"]) >= 1
                    assert r.headers["x-request-id"] == "late-1"

                raws = await asyncio.gather(*(s.rest() for s in [*longs, short]))
                full_long, full_short = await asyncio.gather(long_full, short_full)
        rc = await asyncio.to_thread(server.proc.wait, 30)
    finally:
        server.stop(signal.SIGKILL)

    # the short requests finished normally within the shutdown timeout
    _assert_completed_stream(raws[-1])
    assert short.ended_at - signalled < SHUTDOWN_S
    assert full_short.status_code == 200, full_short.text
    assert full_short.json()["choices"][0]["finish_reason"] == "length"
    # the long ones had their time, then ended with the shutting_down error
    for s, raw in zip(longs, raws):
        _assert_error_event_then_done(raw, "shutting_down")
        assert SHUTDOWN_S - 0.5 <= s.ended_at - signalled <= SHUTDOWN_S + 5.0
    assert full_long.status_code == 503, full_long.text
    assert_error_body(full_long.json(), "shutting_down")
    assert rc == 0, server.log()[-3000:]
    # all five were in flight when the signal came
    assert "stopping: 5 request(s) in flight" in server.log(), server.log()[-3000:]
    assert_all_gone(server, ipc)


async def test_sigint_ends_in_flight_requests_without_waiting_and_exits_0(long_dir):
    # a long shutdown timeout that SIGINT must not wait for
    server = start_server(long_dir, "--max-seq-len", str(CONTEXT), "--shutdown-timeout", "60")
    url = _url(server)
    try:
        ipc = ipc_dir(server)
        async with httpx.AsyncClient(timeout=60) as http:
            async with _Stream(http, url, _long_body(server, stream=True)) as stream:
                await stream.first()
                full = asyncio.create_task(http.post(url, json=_long_body(server, False)))
                await asyncio.to_thread(
                    _wait_state, server, lambda st: st["scheduler"]["running"] == 2
                )
                os.killpg(server.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
                signalled = time.monotonic()
                raw = await stream.rest()
                r = await full
                full_ended = time.monotonic()
        rc = await asyncio.to_thread(server.proc.wait, 30)
    finally:
        server.stop(signal.SIGKILL)
    _assert_error_event_then_done(raw, "shutting_down")
    assert r.status_code == 503, r.text
    assert_error_body(r.json(), "shutting_down")
    # "without waiting": nowhere near the 60 s shutdown timeout
    assert stream.ended_at - signalled < 5.0 and full_ended - signalled < 5.0
    assert rc == 0, server.log()[-3000:]
    assert_all_gone(server, ipc)


# ---------------------------------------------------------------- a worker dies
async def test_tokenizer_sigkill_ends_every_in_flight_request_with_an_error(long_dir):
    server = start_server(long_dir, "--max-seq-len", str(CONTEXT))
    url = _url(server)
    try:
        ipc = ipc_dir(server)
        tokenizer = inbox_owner(server, "tokenizer")
        assert tokenizer not in (server.proc.pid, inbox_owner(server, "scheduler"))
        async with httpx.AsyncClient(timeout=30) as http:
            streams = [_Stream(http, url, _long_body(server, stream=True)) for _ in range(2)]
            async with contextlib.AsyncExitStack() as stack:
                for s in streams:
                    await stack.enter_async_context(s)
                    await s.first()

                async def full() -> tuple[httpx.Response, float]:
                    r = await http.post(url, json=_long_body(server, False))
                    return r, time.monotonic()

                fulls = [asyncio.create_task(full()) for _ in range(2)]
                await asyncio.to_thread(
                    _wait_state, server, lambda st: st["scheduler"]["running"] == 4
                )

                os.kill(tokenizer, signal.SIGKILL)
                killed = time.monotonic()
                raws = await asyncio.wait_for(asyncio.gather(*(s.rest() for s in streams)), 10)
                full_results = await asyncio.wait_for(asyncio.gather(*fulls), 10)

            for s, raw in zip(streams, raws):
                assert s.ended_at - killed < 2.0
                assert b'"finish_reason":"length"' not in raw
                if raw.endswith(SSE_DONE):  # told: an error event, then [DONE]
                    _assert_error_event_then_done(raw, "backend_unavailable")
            for r, ended in full_results:
                assert ended - killed < 2.0
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "backend_unavailable")

            # for a moment the server still answers, with 503, then it exits on its own
            health = await http.get(server.base_url + "/health")
            assert health.status_code == 503
            assert_error_body(health.json(), "backend_unavailable")
            for stream in (False, True):
                r = await http.post(url, json=_short_body(server, stream=stream))
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "backend_unavailable")
        rc = await asyncio.to_thread(server.proc.wait, 15)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 1, server.log()[-3000:]
    assert "the tokenizer process died" in server.log()
    assert_all_gone(server, ipc)
