"""Start the real three-process server (`python -m minisgl`) on a free port for a test.

`RunningServer` waits for /health, knows its base URL, can read /debug/lifecycle (with the
operator's key when it was started with one, so the counts are exact), wait until every
component is back at zero, and stop the server with a signal, checking that
no process and no IPC directory is left behind. By default it serves on the CPU and
returns once the server is healthy; `device=` and `wait=False` (then `wait_healthy()`)
are for the benchmarks, which may run it on a GPU and name its log before a long start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.utils.process import free_port  # noqa: F401  (benchmarks import it from here)

ZERO_FRONTEND = {"requests": 0, "pending_bytes": 0}
ZERO_TOKENIZER = {"decode_states": 0, "tokenizing": 0, "grammar_compiles": 0}
ZERO_SCHEDULER = {
    "pending": 0,
    "running": 0,
    "table_slots_used": 0,
    "kv_pages_used": 0,
    "grammar_matchers": 0,
}


def is_zero(state: dict) -> bool:
    """Every per-request count at zero: the API server's, the tokenizer worker's, and the
    scheduler's (each rank's, with tensor parallelism)."""
    ranks = [state["scheduler"], *state["scheduler"].get("ranks", [])]
    return (
        state["frontend"] == ZERO_FRONTEND
        and state["tokenizer"] == ZERO_TOKENIZER
        and all(
            {k: v for k, v in r.items() if k in ZERO_SCHEDULER} == ZERO_SCHEDULER for r in ranks
        )
    )


def wait_healthy(base_url: str, exited, timeout: float) -> bool:
    """Poll `base_url`/health until it answers 200 (True), `exited()` says the server's
    process is gone, or `timeout` seconds pass (False). Any HTTP server: ours, or the
    benchmarks' llama.cpp and bare uvicorn."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not exited():
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


class RunningServer:
    def __init__(
        self,
        model: str | None,
        *extra: str,
        env: dict[str, str] | None = None,
        device: str = "cpu",
        wait: bool = True,
    ) -> None:
        self.port = free_port()
        self.model_name = model or DEFAULT_MODEL_NAME
        cmd = [sys.executable, "-m", "minisgl", "--device", device, "--port", str(self.port)]
        if model is not None:
            cmd += ["--model", model]
        cmd += list(extra)
        self.cmd = cmd
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"minisgl-test-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=Path(__file__).resolve().parents[2],  # `-m minisgl` works installed or not
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: signals reach only it
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.operator_key = _operator_key(list(extra), env or {})
        if wait:
            self.wait_healthy()

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 180.0) -> None:
        """Return once /health answers 200; RuntimeError (with the log) if the server exits
        first, or if it is not healthy after `timeout` seconds (then it is stopped)."""
        if wait_healthy(self.base_url, lambda: self.proc.poll() is not None, timeout):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def lifecycle(self) -> dict:
        key = self.operator_key
        headers = {"authorization": f"Bearer {key}"} if key else None
        r = httpx.get(f"{self.base_url}/debug/lifecycle", headers=headers, timeout=5)
        r.raise_for_status()
        return r.json()

    def wait_zero(self, timeout: float = 1.0) -> dict:
        """Poll /debug/lifecycle until every component is at zero; fail after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.lifecycle()
            if is_zero(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"lifecycle not back at zero within {timeout} s: {state}")
            time.sleep(0.05)

    def children(self) -> list[int]:
        """Pids of the server's processes (its own process group)."""
        return group_alive(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _operator_key(argv: list[str], env: dict[str, str]) -> str | None:
    """The key that makes a request the operator's on a server started with `argv` and
    `env`: the admin key, else the API key when it is a single one."""

    def given(flag: str, var: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else env.get(var)

    admin, keys = given("--admin-key", "MINISGL_ADMIN_KEY"), given("--api-key", "MINISGL_API_KEY")
    if admin:
        return admin
    return keys if keys and "," not in keys else None


# ---------------------------------------------------------------- worker processes (Linux /proc)
def unix_socket_paths(pid: int) -> list[str]:
    """Paths of the bound unix sockets (ZMQ ipc:// inboxes) that process `pid` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes:
            paths.append(parts[7])
    return paths


def inbox_owner(server: RunningServer, inbox: str) -> int:
    """The pid of the server process that binds the ZMQ inbox `inbox` ("frontend",
    "tokenizer" or "scheduler"): the launcher names one inbox socket per process."""
    for pid in server.children():
        try:
            if any(p.endswith(f"/{inbox}") for p in unix_socket_paths(pid)):
                return pid
        except OSError:  # a process that exited meanwhile
            continue
    raise LookupError(f"no process of the server binds the {inbox!r} inbox")


def ipc_dir(server: RunningServer) -> Path:
    """The server's per-instance IPC directory (where its ZMQ sockets live)."""
    for path in unix_socket_paths(server.proc.pid):
        if path.endswith("/frontend"):
            return Path(path).parent
    raise LookupError("the API server binds no frontend inbox")


# ---------------------------------------------------------------- after the server exits
def group_alive(pgid: int) -> list[int]:
    """Pids still alive in process group `pgid` (the server runs in its own session)."""
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def assert_all_gone(server: RunningServer, ipc: Path, timeout: float = 5.0) -> None:
    """No process of the server's group is alive and its IPC directory `ipc` is removed.
    (Only its own directory: other servers on the machine come and go meanwhile.)"""
    deadline = time.monotonic() + timeout
    while (alive := group_alive(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive == [], f"processes left in the server's group: {alive}"
    assert not ipc.exists(), f"IPC directory left behind: {ipc}"


def group_rss_bytes(server: RunningServer) -> int:
    """Resident memory of all the server's processes together (VmRSS from /proc)."""
    total = 0
    for pid in server.children():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024  # kB
    return total
