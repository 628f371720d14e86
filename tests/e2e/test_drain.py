"""Stopping the real server (tiny Llama, 32k context) with requests in flight: on SIGTERM
/health turns 503 at once, new requests get 503 shutting_down with Retry-After, requests
that finish within --shutdown-timeout finish normally and the others then end with the
shutting_down error, and the server exits 0; SIGINT ends every in-flight request at once
without waiting for the timeout. Either way no process and no IPC directory is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
from e2e_helpers import (
    CONTEXT_32K,
    ENDLESS,
    HeldStream,
    assert_completed_stream,
    assert_error_body,
    assert_error_event_then_done,
    chat_url,
    n_running,
    tokens_body,
    wait_state,
)

from minisgl.testing.server import assert_all_gone, ipc_dir

SHUTDOWN_S = 3.0
SHORT = 150  # tokens: done well within SHUTDOWN_S, yet in flight when the signal comes


async def test_sigterm_drains_in_flight_requests_then_exits_0(start_server):
    server = start_server(
        "context_32k_dir",
        "--max-seq-len",
        str(CONTEXT_32K),
        "--shutdown-timeout",
        str(SHUTDOWN_S),
    )
    url = chat_url(server)
    ipc = ipc_dir(server)
    limits = httpx.Limits(max_connections=16)
    async with (
        httpx.AsyncClient(timeout=60, limits=limits) as http,
        httpx.AsyncClient(timeout=10) as probe,
    ):
        assert (await probe.get(server.base_url + "/health")).status_code == 200  # keep-alive
        longs = [HeldStream(http, url, tokens_body(server, ENDLESS, stream=True)) for _ in range(2)]
        short = HeldStream(http, url, tokens_body(server, SHORT, stream=True))
        async with contextlib.AsyncExitStack() as stack:
            for s in longs:
                await stack.enter_async_context(s)
                await s.first()
            long_full = asyncio.create_task(http.post(url, json=tokens_body(server, ENDLESS)))
            await asyncio.to_thread(wait_state, server, n_running(3))
            # the short ones last a fraction of a second: signal as soon as they run
            short_full = asyncio.create_task(http.post(url, json=tokens_body(server, SHORT)))
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
                    url, json=tokens_body(server, 4), headers={"x-request-id": "late-1"}
                )
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "shutting_down")
                assert int(r.headers["retry-after"]) >= 1
                assert r.headers["x-request-id"] == "late-1"

            raws = await asyncio.gather(*(s.rest() for s in [*longs, short]))
            full_long, full_short = await asyncio.gather(long_full, short_full)
    rc = await asyncio.to_thread(server.proc.wait, 30)

    # the short requests finished normally within the shutdown timeout
    assert_completed_stream(raws[-1])
    assert short.ended_at - signalled < SHUTDOWN_S
    assert full_short.status_code == 200, full_short.text
    assert full_short.json()["choices"][0]["finish_reason"] == "length"
    # the long ones had their time, then ended with the shutting_down error
    for s, raw in zip(longs, raws):
        assert_error_event_then_done(raw, "shutting_down")
        assert SHUTDOWN_S - 0.5 <= s.ended_at - signalled <= SHUTDOWN_S + 5.0
    assert full_long.status_code == 503, full_long.text
    assert_error_body(full_long.json(), "shutting_down")
    assert rc == 0, server.log()[-3000:]
    # all five were in flight when the signal came
    assert "stopping: 5 request(s) in flight" in server.log(), server.log()[-3000:]
    assert_all_gone(server, ipc)


async def test_sigint_ends_in_flight_requests_without_waiting_and_exits_0(start_server):
    # a long shutdown timeout that SIGINT must not wait for
    server = start_server(
        "context_32k_dir", "--max-seq-len", str(CONTEXT_32K), "--shutdown-timeout", "60"
    )
    url = chat_url(server)
    ipc = ipc_dir(server)
    async with httpx.AsyncClient(timeout=60) as http:
        async with HeldStream(http, url, tokens_body(server, ENDLESS, stream=True)) as stream:
            await stream.first()
            full = asyncio.create_task(http.post(url, json=tokens_body(server, ENDLESS)))
            await asyncio.to_thread(wait_state, server, n_running(2))
            os.killpg(server.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
            signalled = time.monotonic()
            raw = await stream.rest()
            r = await full
            full_ended = time.monotonic()
    rc = await asyncio.to_thread(server.proc.wait, 30)
    assert_error_event_then_done(raw, "shutting_down")
    assert r.status_code == 503, r.text
    assert_error_body(r.json(), "shutting_down")
    # "without waiting": nowhere near the 60 s shutdown timeout
    assert stream.ended_at - signalled < 5.0 and full_ended - signalled < 5.0
    assert rc == 0, server.log()[-3000:]
    assert_all_gone(server, ipc)
