"""A worker process of the real server (tiny Llama) killed with SIGKILL, the tokenizer or
the scheduler: every in-flight request, streamed or not, ends with backend_unavailable
within two seconds (a stream with an error event and [DONE], or cut off; never finished),
/health and new requests answer 503 for the moment the server still runs, then it exits 1
on its own, naming the dead worker, and leaves no process and no IPC directory behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import pytest
from e2e_helpers import (
    CONTEXT_32K,
    ENDLESS,
    SSE_DONE,
    HeldStream,
    assert_error_body,
    assert_error_event_then_done,
    assert_no_new_ipc_dirs,
    chat_url,
    ipc_dirs,
    n_running,
    tokens_body,
    wait_state,
)

from minisgl.testing.server import assert_all_gone, inbox_owner, ipc_dir

# worker -> (model, its context, tokens of a request that stays in flight)
WORKERS = {
    "tokenizer": ("context_32k_dir", CONTEXT_32K, ENDLESS),
    "scheduler": ("long_context_dir", 4096, 4000),
}
OTHER = {"tokenizer": "scheduler", "scheduler": "tokenizer"}


@pytest.mark.parametrize("worker", list(WORKERS))
async def test_worker_sigkill_ends_every_in_flight_request_with_an_error(start_server, worker):
    model, context, long = WORKERS[worker]
    before = ipc_dirs()
    server = start_server(model, "--max-seq-len", str(context))
    url = chat_url(server)
    ipc = ipc_dir(server)
    pid = inbox_owner(server, worker)
    assert pid not in (server.proc.pid, inbox_owner(server, OTHER[worker]))
    async with httpx.AsyncClient(timeout=30) as http:
        streams = [HeldStream(http, url, tokens_body(server, long, stream=True)) for _ in range(2)]
        async with contextlib.AsyncExitStack() as stack:
            for s in streams:
                await stack.enter_async_context(s)
                await s.first()

            async def full() -> tuple[httpx.Response, float]:
                r = await http.post(url, json=tokens_body(server, long))
                return r, time.monotonic()

            fulls = [asyncio.create_task(full()) for _ in range(2)]
            await asyncio.to_thread(wait_state, server, n_running(4))

            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            raws = await asyncio.wait_for(asyncio.gather(*(s.rest() for s in streams)), 10)
            full_results = await asyncio.wait_for(asyncio.gather(*fulls), 10)

        for s, raw in zip(streams, raws):
            assert s.ended_at - killed < 2.0
            assert b'"finish_reason":"length"' not in raw
            if raw.endswith(SSE_DONE):  # told: an error event, then [DONE]
                assert_error_event_then_done(raw, "backend_unavailable")
        for r, ended in full_results:
            assert ended - killed < 2.0
            assert r.status_code == 503, r.text
            assert_error_body(r.json(), "backend_unavailable")

        # for a moment the server still answers, with 503, then it exits on its own
        health = await http.get(server.base_url + "/health")
        assert health.status_code == 503
        assert_error_body(health.json(), "backend_unavailable")
        for stream in (False, True):
            r = await http.post(url, json=tokens_body(server, 4, stream=stream))
            assert r.status_code == 503, r.text
            assert_error_body(r.json(), "backend_unavailable")
    rc = await asyncio.to_thread(server.proc.wait, 15)
    assert rc == 1, server.log()[-3000:]
    assert f"the {worker} process died" in server.log()
    assert_all_gone(server, ipc)
    assert_no_new_ipc_dirs(before)
