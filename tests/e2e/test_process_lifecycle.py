"""The server's processes (tiny Llama): SIGINT and SIGTERM stop all three and remove the IPC
directory, leaving no process and no new IPC directory behind; an API server killed with
SIGKILL while a request is generating takes the workers with it within a second or so (they
stop generating for nobody) and they remove the IPC directory. (A worker killed with
SIGKILL: test_worker_crash.py.)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from e2e_helpers import ENDLESS, assert_no_new_ipc_dirs, chat_body, chat_url, ipc_dirs

from minisgl.testing.server import assert_all_gone, inbox_owner, ipc_dir


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_all_three_processes_and_removes_the_ipc_dir(start_server, sig):
    before = ipc_dirs()
    server = start_server("llama")
    ipc = ipc_dir(server)
    assert ipc.is_dir() and ipc.stat().st_mode & 0o777 == 0o700
    workers = {inbox_owner(server, "scheduler"), inbox_owner(server, "tokenizer")}
    assert len(workers) == 2 and server.proc.pid not in workers
    r = httpx.post(chat_url(server), json=chat_body(server.model_name, max_tokens=2))
    assert r.status_code == 200
    if sig == signal.SIGINT:  # Ctrl-C in a terminal reaches the whole process group
        os.killpg(server.proc.pid, sig)
    else:  # a service manager signals the main process
        server.proc.send_signal(sig)
    rc = server.proc.wait(30)
    assert rc == 0, server.log()[-3000:]
    assert_all_gone(server, ipc)
    assert_no_new_ipc_dirs(before)


def test_the_workers_die_with_a_killed_api_server_and_remove_the_ipc_dir(start_server):
    before = ipc_dirs()
    server = start_server("context_32k_dir", "--max-seq-len", "32768")
    ipc = ipc_dir(server)
    body = chat_body(server.model_name, max_tokens=ENDLESS, ignore_eos=True, stream=True)
    with httpx.stream("POST", chat_url(server), json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # generating: the scheduler is busy, not idle in a receive
        os.kill(server.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        server.proc.wait(10)
    assert_all_gone(server, ipc, timeout=10.0)
    # the watchdog looks twice a second; generous for a loaded machine, far from the 84 s
    # the scheduler used to go on generating
    assert time.monotonic() - killed < 10.0
    assert_no_new_ipc_dirs(before)
