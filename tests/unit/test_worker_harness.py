"""The worker harness (minisgl/utils/worker.py) that starts every worker process: a build
that fails reaches the launcher as ("error", "<role> failed to start: <reason>") and the
process exits 1; a build that succeeds says ("ready", info) and then its serve loop runs,
with the heartbeat beating, on what the build made frozen out of the garbage collector's
walks; a worker whose launcher is killed cleans up (`on_orphaned`) and exits by itself,
whatever its loop is doing. Each in a real spawned process,
as the launcher starts them."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time

from minisgl.utils.heartbeat import new_heartbeat
from minisgl.utils.worker import ParentWatch, Serving, run_worker

CTX = mp.get_context("spawn")


def _failing_build(parent: ParentWatch) -> Serving:
    raise RuntimeError("/models/x has no tokenizer: the server needs one")


def _fails(ready) -> None:
    run_worker("tokenizer", "tokenizer worker", "warning", _failing_build, ready)


def test_a_build_failure_reaches_the_launcher_with_its_reason_and_exit_status_1():
    recv, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_fails, args=(send,), daemon=True)
    proc.start()
    assert recv.poll(60)
    assert recv.recv() == (
        "error",
        "tokenizer worker failed to start: /models/x has no tokenizer: the server needs one",
    )
    proc.join(30)
    assert proc.exitcode == 1


def _serves(ready, heartbeat, served) -> None:
    def build(parent: ParentWatch) -> Serving:
        def loop() -> None:
            time.sleep(1.2)  # long enough for the heartbeat to beat again
            served.value = 1 if parent.alive() else 2

        return Serving(loop, {"max_seq_len": 7})

    run_worker("scheduler", "scheduler", "warning", build, ready, heartbeat)


def test_a_built_worker_says_ready_with_its_info_then_serves_with_a_heartbeat():
    recv, send = CTX.Pipe(duplex=False)
    heartbeat, served = new_heartbeat(CTX), CTX.Value("i", 0)
    started = heartbeat.value
    proc = CTX.Process(target=_serves, args=(send, heartbeat, served), daemon=True)
    proc.start()
    assert recv.poll(60)
    assert recv.recv() == ("ready", {"max_seq_len": 7})
    proc.join(30)
    assert proc.exitcode == 0
    assert served.value == 1  # the loop ran, and saw its parent alive
    assert heartbeat.value > started  # the worker beat


def _frozen(ready, seen) -> None:
    def build(parent: ParentWatch) -> Serving:
        model = [object() for _ in range(1000)]  # what a worker builds: kept until exit

        def loop() -> None:
            assert len(model) == 1000  # the loop serves with what was built
            seen.value = gc.get_freeze_count()

        return Serving(loop)

    run_worker("tokenizer", "tokenizer worker", "warning", build, ready)


def test_the_serve_loop_starts_with_what_the_build_made_frozen_out_of_the_collector():
    recv, send = CTX.Pipe(duplex=False)
    seen = CTX.Value("i", 0)
    proc = CTX.Process(target=_frozen, args=(send, seen), daemon=True)
    proc.start()
    assert recv.poll(60) and recv.recv()[0] == "ready"
    proc.join(30)
    assert proc.exitcode == 0
    assert seen.value > 1000  # the build's objects and its imports: no full walk meets them


def _blocked_forever(ready, left_behind: str) -> None:
    def build(parent: ParentWatch) -> Serving:
        return Serving(lambda: time.sleep(3600))  # like a rank blocked in a collective

    run_worker(
        "rank-1", "rank 1", "warning", build, ready, on_orphaned=lambda: os.rmdir(left_behind)
    )


def _launcher(pids, left_behind: str) -> None:
    recv, send = CTX.Pipe(duplex=False)
    worker = CTX.Process(target=_blocked_forever, args=(send, left_behind))
    worker.start()
    assert recv.recv()[0] == "ready"
    pids.put(worker.pid)
    time.sleep(3600)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_a_worker_whose_launcher_is_killed_cleans_up_and_exits_by_itself(tmp_path):
    left_behind = tmp_path / "ipc"  # what the launcher would have removed
    left_behind.mkdir()
    pids = CTX.Queue()
    launcher = CTX.Process(target=_launcher, args=(pids, str(left_behind)))  # not a daemon
    launcher.start()
    try:
        pid = pids.get(timeout=60)
    finally:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.join()
    deadline = time.monotonic() + 10  # the watchdog looks twice a second
    try:
        while not _gone(pid):
            assert time.monotonic() < deadline, "the orphaned worker is still running"
            time.sleep(0.1)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert not left_behind.exists()  # `on_orphaned` ran before the exit
