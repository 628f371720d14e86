"""X-Request-Id on the real server: every answer (served, streamed, refused, unknown route,
wrong method, the operational routes) echoes the client's id or carries a generated one,
and an id unfit for a log line or a header is replaced, never echoed; the log line that
warns of a stalled client names its request's id."""

from __future__ import annotations

import time

import httpx
import pytest
from e2e_helpers import (
    AUTH,
    CHAT_PATH,
    GENERATED_ID,
    KEY_SERVER,
    LIMITS_SERVER,
    STALL_S,
    assert_error_body,
    changed,
    chat_body,
    raw_post,
    read_until_closed,
    request_counts,
    scrape_metrics,
    tokens_body,
)

pytestmark = pytest.mark.server(LIMITS_SERVER)


def _chat(**params):
    return lambda model: chat_body(model, max_tokens=4, ignore_eos=True, **params)


# name -> (method, path, body from the model name (dict, raw bytes or None), status)
ID_CASES = {
    "chat_200": ("POST", CHAT_PATH, _chat(), 200),
    "chat_stream_200": ("POST", CHAT_PATH, _chat(stream=True), 200),
    "malformed_json_400": ("POST", CHAT_PATH, lambda model: b'{"model": ', 400),
    "bad_param_400": ("POST", CHAT_PATH, _chat(top_p=0), 400),
    "unknown_model_404": ("POST", CHAT_PATH, lambda model: chat_body("no-such-model"), 404),
    "unknown_route_404": ("GET", "/v1/nothing-here", lambda model: None, 404),
    "wrong_method_405": ("GET", CHAT_PATH, lambda model: None, 405),
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


@pytest.mark.server(KEY_SERVER)  # its stall timeout is a second: the warning comes soon
def test_stall_warning_names_the_request_id(server):
    before = scrape_metrics(server)
    request_id = "stall-probe-7"

    def stall_warnings() -> list[str]:
        return [line for line in server.log().splitlines() if "read nothing" in line]

    seen = len(stall_warnings())
    sock = raw_post(
        server.port,
        CHAT_PATH,
        tokens_body(server, 4000, stream=True),
        rcvbuf=4096,
        headers={**AUTH, "X-Request-Id": request_id},
    )
    try:
        deadline = time.monotonic() + 60
        while len(stall_warnings()) == seen:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
        server.wait_zero(STALL_S + 2.0)
        received = read_until_closed(sock, bytearray(), ends=(ConnectionResetError, TimeoutError))
    finally:
        sock.close()
    warnings = stall_warnings()[seen:]  # the server is shared: earlier stalls are in its log
    assert len(warnings) == 1 and request_id in warnings[0], warnings
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert f"x-request-id: {request_id}".encode() in head, head
    after = scrape_metrics(server)
    assert changed(request_counts(after), request_counts(before)) == {
        ("aborted_slow_client", ""): 1
    }
