"""The server's processes (tiny Llama): SIGINT and SIGTERM stop all three and remove the IPC
directory; a scheduler killed with SIGKILL ends every in-flight request with an error at
once, and /health and new requests answer 503."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import SSE_DONE, assert_error_body, chat_body, split_sse, start_server
from minisgl.testing.server import inbox_owner, ipc_dir

PATH = "/v1/chat/completions"


def _ipc_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("minisgl-*")) - set(
        Path(tempfile.gettempdir()).glob("minisgl-test-*")
    )


def _in_use(d: Path) -> bool:
    """Whether a live process still holds a unix socket inside `d` (another server's)."""
    text = Path("/proc/net/unix").read_text()
    return f" {d}/" in text


def _group_alive(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _assert_all_gone(server, ipc: Path, before: set[Path], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (alive := _group_alive(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive == [], f"processes left in the server's group: {alive}"
    assert not ipc.exists(), f"IPC directory left behind: {ipc}"
    leftover = {d for d in _ipc_dirs() - before if not _in_use(d)}
    assert leftover == set(), f"new IPC directories left behind: {leftover}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_all_three_processes_and_removes_the_ipc_dir(tiny_dirs, sig):
    before = _ipc_dirs()
    server = start_server(tiny_dirs["llama"])
    try:
        ipc = ipc_dir(server)
        assert ipc.is_dir() and ipc.stat().st_mode & 0o777 == 0o700
        workers = {inbox_owner(server, "scheduler"), inbox_owner(server, "tokenizer")}
        assert len(workers) == 2 and server.proc.pid not in workers
        r = httpx.post(server.base_url + PATH, json=chat_body(server.model_name, max_tokens=2))
        assert r.status_code == 200
        if sig == signal.SIGINT:  # Ctrl-C in a terminal reaches the whole process group
            os.killpg(server.proc.pid, sig)
        else:  # a service manager signals the main process
            server.proc.send_signal(sig)
        rc = server.proc.wait(30)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 0, server.log()[-3000:]
    _assert_all_gone(server, ipc, before)


async def test_scheduler_sigkill_ends_every_in_flight_request_with_an_error(long_context_dir):
    before = _ipc_dirs()
    server = start_server(long_context_dir, "--max-seq-len", "4096")
    url = server.base_url + PATH
    try:
        ipc = ipc_dir(server)
        scheduler = inbox_owner(server, "scheduler")
        long_body = chat_body(server.model_name, max_tokens=4000, ignore_eos=True)
        async with httpx.AsyncClient(timeout=30) as http:
            streaming = [asyncio.Event(), asyncio.Event()]

            async def stream(started: asyncio.Event) -> tuple[bytes, float]:
                async with http.stream("POST", url, json={**long_body, "stream": True}) as r:
                    assert r.status_code == 200
                    raw = b""
                    try:
                        async for part in r.aiter_raw():
                            raw += part
                            started.set()
                    except httpx.RemoteProtocolError:  # closed mid-stream: also an end
                        pass
                return raw, time.monotonic()

            async def full() -> tuple[httpx.Response, float]:
                r = await http.post(url, json=long_body)
                return r, time.monotonic()

            streams = [asyncio.create_task(stream(ev)) for ev in streaming]
            fulls = [asyncio.create_task(full()) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in streaming)), 30)
            deadline = time.monotonic() + 30
            while (await http.get(server.base_url + "/debug/lifecycle")).json()["scheduler"][
                "running"
            ] < 4:
                assert time.monotonic() < deadline, "the four requests never all ran"
                await asyncio.sleep(0.02)

            os.kill(scheduler, signal.SIGKILL)
            killed = time.monotonic()
            stream_results = await asyncio.wait_for(asyncio.gather(*streams), 10)
            full_results = await asyncio.wait_for(asyncio.gather(*fulls), 10)

            for raw, ended in stream_results:
                assert ended - killed < 2.0
                assert b'"finish_reason":"length"' not in raw
                if raw.endswith(SSE_DONE):  # told: an error event, then [DONE]
                    payloads = split_sse(raw)
                    assert_error_body(json.loads(payloads[-2]), "backend_unavailable")
            for r, ended in full_results:
                assert ended - killed < 2.0
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "backend_unavailable")

            # for a moment the server still answers, with 503, then it exits on its own
            health = await http.get(server.base_url + "/health")
            assert health.status_code == 503
            assert_error_body(health.json(), "backend_unavailable")
            for stream_flag in (False, True):
                body = chat_body(server.model_name, max_tokens=2, stream=stream_flag)
                r = await http.post(url, json=body)
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "backend_unavailable")
        rc = server.proc.wait(15)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 1, server.log()[-3000:]
    assert "the scheduler process died" in server.log()
    _assert_all_gone(server, ipc, before)
