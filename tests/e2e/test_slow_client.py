"""Bounded memory for clients that do not keep up (rule 6 of the lifecycle contract): a
streaming client that reads nothing is aborted after --client-stall-timeout; one that reads
too slowly is aborted once its unread output passes --max-pending-bytes. Either way the
backend is freed and /debug/lifecycle returns to zero.

The server runs the `long_token_dir` model (each token is about 16 KB of text), so that a
few hundred tokens fill the ~3 MB that loopback socket buffers absorb before a send blocks.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from e2e_helpers import (
    CHAT_PATH,
    SSE_DONE,
    TOKEN_CHARS,
    ServerSpec,
    assert_completed_stream,
    assert_error_body,
    chat_url,
    chunk_text,
    dechunk,
    raw_post,
    read_until_closed,
    tokens_body,
)

from minisgl.testing.sse import DONE, sse_payloads

STALL_S = 2.0
PENDING_CAP = 32 * TOKEN_CHARS  # about 32 tokens of unread text

pytestmark = pytest.mark.server(
    ServerSpec(
        "long_token_dir",
        (
            "--max-seq-len",
            "4096",
            "--max-running-requests",
            "4",
            "--client-stall-timeout",
            str(STALL_S),
            "--max-pending-bytes",
            str(PENDING_CAP),
        ),
    )
)


def _endless_stream(server) -> dict:
    # 4000 tokens of 16 KB: far more than any socket buffer, so it cannot finish unread
    return tokens_body(server, 4000, stream=True)


def _wait_backend_freed(server, timeout: float = 60.0) -> float:
    """Wait until the scheduler ran the request and then dropped it while the API server
    still holds it (its send to the client is blocked); return that moment."""
    deadline = time.monotonic() + timeout
    seen_running = False
    while time.monotonic() < deadline:
        state = server.lifecycle()
        running = state["scheduler"]["running"] + state["scheduler"]["pending"]
        seen_running |= running > 0
        if seen_running and running == 0:
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"the request was never dropped by the scheduler: {state}")


def test_a_client_that_keeps_up_gets_every_token(server):
    body = tokens_body(server, 20, stream=True)
    with httpx.stream("POST", chat_url(server), json=body, timeout=60) as r:
        raw = r.read()
    assert r.status_code == 200
    text = chunk_text(assert_completed_stream(raw))
    assert len(text) > TOKEN_CHARS  # several of the 16 KB tokens went through


def test_a_client_that_reads_nothing_is_aborted_after_the_stall_timeout(server):
    sock = raw_post(server.port, CHAT_PATH, _endless_stream(server), rcvbuf=4096)
    try:
        freed = _wait_backend_freed(server)
        # the stall clock started when the send blocked, before the backend was freed
        server.wait_zero(STALL_S + 2.0)
        assert time.monotonic() - freed < STALL_S + 2.0
        log = server.log()
        assert "read nothing" in log, log[-3000:]
        received = bytearray()
        read_until_closed(sock, received)  # the server closed the connection: the drain ends
    finally:
        sock.close()
    body, complete = dechunk(bytes(received))
    assert not complete or b'"slow_client"' in body  # cut off, or told why: never finished
    assert b'"finish_reason":"length"' not in body


def test_a_client_that_reads_slowly_is_aborted_past_max_pending_bytes(server):
    sock = raw_post(server.port, CHAT_PATH, _endless_stream(server), rcvbuf=4096)
    received = bytearray()
    try:
        sock.settimeout(10)
        # read a trickle while the scheduler runs; stop once it has dropped the request
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for _ in range(5):
                received += sock.recv(512)
                time.sleep(0.01)
            state = server.lifecycle()["scheduler"]
            if state["running"] + state["pending"] == 0 and len(received) > 512:
                break
        freed = time.monotonic()
        log = server.log()
        assert "wait unread" in log, log[-3000:]  # the pending-bytes cap fired
        read_until_closed(sock, received)  # catch up: what is still on its way, if anything
        server.wait_zero(1.0)
        assert time.monotonic() - freed < STALL_S + 2.0
    finally:
        sock.close()
    body, complete = dechunk(bytes(received))
    assert b'"finish_reason":"length"' not in body
    if complete:  # told: one error event, then [DONE]
        payloads = sse_payloads(body)
        assert payloads[-1] == DONE and body.count(SSE_DONE) == 1
        assert_error_body(json.loads(payloads[-2]), "slow_client")
    else:  # or cut off mid-stream: no [DONE]
        assert SSE_DONE not in body
