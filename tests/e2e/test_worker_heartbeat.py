"""A frozen worker (SIGSTOP) is reported: /health answers 503 naming it once it has missed
its heartbeat for --worker-heartbeat-timeout seconds, new requests are refused with the
same 503 at once (not admitted to hang behind it), and /health is 200 again once it runs
on (SIGCONT), after which requests are served as before. The scheduler and the tokenizer
worker each, on the real server (tiny Llama)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from e2e_helpers import ServerSpec, assert_error_body, chat_url, tokens_body

from minisgl.testing.server import inbox_owner

TIMEOUT_S = 1.5
pytestmark = pytest.mark.server(ServerSpec("llama", ("--worker-heartbeat-timeout", str(TIMEOUT_S))))


def _wait_health(server, status: int, within: float) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        r = httpx.get(server.base_url + "/health", timeout=5)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, (status, r.status_code, r.text)
        time.sleep(0.1)


@pytest.mark.parametrize("worker", ["scheduler", "tokenizer"])
def test_a_frozen_worker_is_unhealthy_until_it_runs_again(server, worker):
    pid = inbox_owner(server, worker)
    assert httpx.get(server.base_url + "/health").status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        r = _wait_health(server, 503, TIMEOUT_S + 3)
        assert time.monotonic() - stopped >= TIMEOUT_S - 0.6  # not before it is overdue
        error = assert_error_body(r.json(), "backend_unavailable")
        assert f"the {worker} process has not answered" in error["message"]
        for stream in (False, True):  # refused at once, not left to hang
            start = time.monotonic()
            refused = httpx.post(chat_url(server), json=tokens_body(server, 3, stream=stream))
            assert refused.status_code == 503 and time.monotonic() - start < 2.0, refused.text
            assert f"the {worker} process" in refused.json()["error"]["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait_health(server, 200, 3.0)
    r = httpx.post(chat_url(server), json=tokens_body(server, 3), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
