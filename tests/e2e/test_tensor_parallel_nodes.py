"""`--nnodes 2` on one machine: node 1 (`--node-rank 1`) runs only rank 1, node 0 serves
HTTP with rank 0; they meet at MASTER_ADDR:MASTER_PORT as on two machines. Requests are
served with both ranks (/debug/lifecycle lists them, rank 1 in node 1's process group);
when node 0 stops, node 1's rank and launcher exit too, leaving no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from e2e_helpers import chat_url, tokens_body

from minisgl.testing.server import group_alive
from minisgl.utils.process import free_port

pytestmark = pytest.mark.slow


def test_two_nodes_on_one_machine_serve_and_stop_together(start_server, tiny_dirs):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    flags = ["--tp-size", "2", "--nnodes", "2", "--max-seq-len", "256", "--device", "cpu"]
    model = str(tiny_dirs["llama"])
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minisgl", "--model", model, *flags, "--node-rank", "1"],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        server = start_server("llama", *flags, "--node-rank", "0", env=env)
        r = httpx.post(chat_url(server), json=tokens_body(server, 6), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        ranks = server.wait_zero(5.0)["scheduler"]["ranks"]
        assert [x["rank"] for x in ranks] == [0, 1]
        assert ranks[1]["pid"] in group_alive(node1.pid)  # rank 1 is node 1's child
        assert ranks[1]["pid"] not in server.children()
        server.stop(signal.SIGTERM)
        assert node1.wait(30) is not None  # node 1 ends with node 0
        deadline = time.monotonic() + 10
        while group_alive(node1.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_alive(node1.pid) == []
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
