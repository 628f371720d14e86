"""The real server with `--tp-size 2` on the CPU (tiny Llama, two ranks on gloo): the
official client gets the same greedy tokens as one rank gives, streamed or not; a
disconnect mid-stream, an over-long prompt (400) and a normal request leave every rank's
scheduler at zero in /debug/lifecycle, which reports each rank; and SIGKILL of rank 1 ends
every in-flight request with an error within two seconds, after which the server exits
non-zero and leaves no process behind; SIGSTOP of rank 1 does the same within
--dist-timeout, while /health and /debug/lifecycle keep answering; and SIGTERM stops every
rank with exit 0, also while one of them is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import pytest
from e2e_helpers import (
    SSE_DONE,
    HeldStream,
    ServerSpec,
    assert_error_body,
    assert_error_event_then_done,
    chat_body,
    chat_url,
    tokens_body,
)

from minisgl import LLM, SamplingParams
from minisgl.testing.server import assert_all_gone, ipc_dir

TP = ("--tp-size", "2", "--max-seq-len", "256", "--page-size", "4")
pytestmark = pytest.mark.server(ServerSpec("llama", TP))
PROMPT = [(j * 11) % 500 + 3 for j in range(20)]


def _ranks(server) -> list[dict]:
    return server.lifecycle()["scheduler"]["ranks"]


def test_two_ranks_serve_one_rank_s_greedy_tokens(server, client, tiny_dirs):
    (want,) = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4).generate(
        [PROMPT], SamplingParams(max_tokens=12, ignore_eos=True)
    )
    params = dict(model=server.model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**params, extra_body={"ignore_eos": True})
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**params, stream=True, extra_body={"ignore_eos": True})
        if c.choices
    )
    assert full.choices[0].text == streamed == want.text
    assert [r["rank"] for r in _ranks(server)] == [0, 1]


def test_every_ending_leaves_every_rank_at_zero(server, client):
    url = chat_url(server)
    with httpx.stream("POST", url, json=tokens_body(server, 200, stream=True), timeout=30) as r:
        next(r.iter_raw())  # the client leaves mid-stream
    long = chat_body(server.model_name, "word " * 400, max_tokens=4)
    assert httpx.post(url, json=long, timeout=30).status_code == 400
    r = httpx.post(url, json=tokens_body(server, 5), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    state = server.wait_zero(5.0)
    assert len(state["scheduler"]["ranks"]) == 2


def _rank_1(server) -> int:
    (pid,) = [r["pid"] for r in _ranks(server) if r["rank"] == 1]
    return pid


async def _signal_rank_1_mid_request(server, sig: int, wait_s: float, during=None):
    """A stream (held after its first chunk) and a non-streamed request are in flight when
    rank 1 gets `sig`; `during(http)` runs right after the signal. Returns the stream's raw
    bytes, the non-streamed response, the seconds from the signal to the stream's end and
    to both ends, and what `during` returned. Either request waits at most `wait_s`."""
    rank1, url = _rank_1(server), chat_url(server)
    async with httpx.AsyncClient(timeout=60) as http:
        async with HeldStream(http, url, tokens_body(server, 230, stream=True)) as stream:
            await stream.first()
            full = asyncio.create_task(http.post(url, json=tokens_body(server, 230)))
            await asyncio.sleep(0.3)
            os.kill(rank1, sig)
            sent = time.monotonic()
            seen = await during(http) if during else None
            raw = await asyncio.wait_for(stream.rest(), wait_s)
            r = await asyncio.wait_for(full, wait_s)
            both = time.monotonic() - sent
    assert b'"finish_reason":"length"' not in raw
    if raw.endswith(SSE_DONE):
        assert_error_event_then_done(raw, "backend_unavailable")
    assert r.status_code == 503, r.text
    return raw, r, stream.ended_at - sent, both, seen


async def test_sigkill_of_rank_1_ends_every_request_and_the_server(start_server):
    server = start_server("llama", *TP)
    ipc = ipc_dir(server)
    assert _rank_1(server) in server.children()
    _, r, stream_s, both_s, _ = await _signal_rank_1_mid_request(server, signal.SIGKILL, 10)
    assert stream_s < 2.0 and both_s < 2.5
    assert_error_body(r.json(), "backend_unavailable")
    rc = await asyncio.to_thread(server.proc.wait, 20)
    assert rc != 0, server.log()[-3000:]
    assert_all_gone(server, ipc)


def test_sigterm_stops_every_rank(start_server):
    server = start_server("llama", *TP)
    ipc = ipc_dir(server)
    ranks = [r["pid"] for r in _ranks(server)]
    assert all(pid in server.children() for pid in ranks)
    r = httpx.post(chat_url(server), json=tokens_body(server, 4), timeout=30)
    assert r.status_code == 200
    assert server.stop(signal.SIGTERM) == 0, server.log()[-3000:]
    assert_all_gone(server, ipc)  # no rank left behind, blocked in a collective or not


DIST_TIMEOUT = 3.0


async def test_a_stopped_rank_ends_every_request_within_the_timeout(start_server):
    server = start_server("llama", *TP, "--dist-timeout", str(DIST_TIMEOUT))
    ipc = ipc_dir(server)
    rank1 = _rank_1(server)

    async def answers(http):  # while rank 0 waits for it, the server answers (503: not in step)
        return [(await http.get(f"{server.base_url}{path}")).status_code
                for path in ("/health", "/debug/lifecycle")]  # fmt: skip

    try:
        _, r, stream_s, _, codes = await _signal_rank_1_mid_request(
            server, signal.SIGSTOP, DIST_TIMEOUT + 30, during=answers
        )
        assert all(code in (200, 503) for code in codes)
        assert stream_s < DIST_TIMEOUT + 10
        assert "did not answer" in r.json()["error"]["message"] or "died" in r.text
        rc = await asyncio.to_thread(server.proc.wait, 30)
        assert rc != 0, server.log()[-3000:]
        assert_all_gone(server, ipc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)


@pytest.mark.parametrize("second", [False, True], ids=["once", "twice"])
def test_sigterm_stops_every_rank_also_while_one_is_stopped(start_server, second):
    server = start_server("llama", *TP, "--dist-timeout", str(DIST_TIMEOUT))
    ipc = ipc_dir(server)
    rank1 = _rank_1(server)
    os.kill(rank1, signal.SIGSTOP)
    try:
        server.proc.send_signal(signal.SIGTERM)
        if second:  # while the stopped rank is being stopped: it hurries, never kills
            deadline = time.monotonic() + 10
            while server.proc.poll() is None and time.monotonic() < deadline:
                if "stopping:" in server.log():
                    time.sleep(0.5)
                    server.proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.05)
        assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log()[-3000:]
        assert_all_gone(server, ipc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)
