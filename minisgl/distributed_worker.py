"""The ranks of a tensor-parallel model other than rank 0: each a process with its own
engine (its shard) and scheduler, making the calls rank 0's scheduler broadcasts.

Contract:
- Offline: `start_ranks(engine_config, scheduler_config)` is called by an `LLM` (rank 0)
  before it builds its own engine: it picks a free local port for the process group,
  starts ranks 1..N-1 (spawned, so each imports torch afresh), joins the group as rank 0
  and returns the processes, which run `rank_main`.
- Server: the launcher starts the ranks of its machine itself, as `rank_worker`
  processes next to the scheduler (rank 0), and watches them like its other workers.
Either way a rank joins the group, builds its engine and scheduler, and follows rank 0
until told to stop. A rank whose parent process dies exits within a second (a watchdog
thread), so an aborted run leaves no rank blocked in a collective behind it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(engine_config, scheduler_config) -> list[mp.process.BaseProcess]:
    from minisgl.distributed import init_tp

    size = engine_config.tp_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    device_type = engine_config.resolve_device().type
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=rank_main,
            args=(engine_config, scheduler_config, rank, init_method, os.getpid()),
            name=f"minisgl-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for proc in procs:
        proc.start()
    init_tp(0, size, init_method, device_type)
    return procs


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)  # blocked in a collective: nothing else would end this process


def rank_main(engine_config, scheduler_config, rank: int, init_method: str, parent: int) -> None:
    import torch

    from minisgl.distributed import destroy_tp, init_tp
    from minisgl.engine.engine import Engine
    from minisgl.scheduler import Scheduler

    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    init_tp(rank, engine_config.tp_size, init_method, engine_config.resolve_device().type)
    with torch.inference_mode():
        scheduler = Scheduler(Engine(engine_config), scheduler_config)
        scheduler.follow()
    destroy_tp()


def rank_worker(args, model_dir, rank: int, ready, heartbeat=None) -> None:
    """The server's process for tensor-parallel rank `rank` (not 0): report readiness (or
    why it could not start) to the launcher, then follow rank 0."""
    import dataclasses
    import logging

    import torch

    from minisgl.distributed import destroy_tp, init_tp
    from minisgl.engine.engine import Engine
    from minisgl.scheduler import Scheduler
    from minisgl.utils.heartbeat import start_beating
    from minisgl.utils.process import configure_worker_logging

    configure_worker_logging(f"rank-{rank}", args.log_level)
    start_beating(heartbeat)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    config = dataclasses.replace(args.engine_config, model=str(model_dir))
    try:
        if config.device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) - 2))  # as the scheduler
        init_tp(rank, config.tp_size, args.dist_init_method, config.resolve_device().type)
        scheduler = Scheduler(Engine(config), args.scheduler_config)
    except Exception as exc:
        logging.getLogger(__name__).exception("rank %d failed to start", rank)
        ready.send(("error", f"rank {rank} failed to start: {exc}"))
        raise SystemExit(1) from exc
    ready.send(("ready", {"rank": rank}))
    with torch.inference_mode():
        scheduler.follow()
    destroy_tp()
