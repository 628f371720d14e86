"""The ranks of a tensor-parallel model other than rank 0: each a process with its own
engine (its shard) and scheduler, making the calls rank 0's scheduler broadcasts
(`Ranks.follow`, minisgl/scheduler/ranks.py).

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

import functools
import multiprocessing as mp

from minisgl.utils.process import free_port
from minisgl.utils.worker import ParentWatch, Serving, run_worker


def start_ranks(engine_config, scheduler_config) -> list[mp.process.BaseProcess]:
    from minisgl.distributed import init_tp

    size = engine_config.tp_size
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=rank_main,
            args=(engine_config, scheduler_config, rank, init_method),
            name=f"minisgl-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for proc in procs:
        proc.start()
    init_tp(0, size, init_method, engine_config.resolve_device().type, engine_config.dist_timeout)
    return procs


def stop_ranks(scheduler, procs: list, failed: bool = False) -> None:
    """Rank 0: stop the other ranks (told to, or killed when the group has `failed` or
    does not answer) and leave the process group."""
    from minisgl.distributed import RanksFailed, destroy_tp

    failed = failed or scheduler is None  # no scheduler: they never got to follow it
    if not failed:
        try:
            scheduler.ranks.stop()
        except RanksFailed:
            failed = True
    for proc in procs:
        proc.join(0 if failed else 30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    destroy_tp()


def _join(engine_config, scheduler_config, rank: int, init_method: str):
    """Join the ranks' process group and build this rank's engine and scheduler."""
    from minisgl.distributed import init_tp
    from minisgl.engine.build import build_engine
    from minisgl.scheduler import Scheduler

    device = engine_config.resolve_device().type
    init_tp(rank, engine_config.tp_size, init_method, device, engine_config.dist_timeout)
    return Scheduler(build_engine(engine_config), scheduler_config)


def _follow(scheduler) -> None:
    import logging

    import torch

    from minisgl.distributed import RanksFailed, destroy_tp

    try:
        with torch.inference_mode():
            scheduler.ranks.follow(scheduler)
    except RanksFailed as exc:  # rank 0 went away (or another rank stopped): nothing to follow
        logging.getLogger(__name__).error("rank %d stops: %s", scheduler.ranks.tp.rank, exc)
        raise SystemExit(1) from None
    destroy_tp()


def rank_main(engine_config, scheduler_config, rank: int, init_method: str) -> None:
    """An offline `LLM`'s rank `rank` (not 0)."""
    ParentWatch().exit_with_parent()
    _follow(_join(engine_config, scheduler_config, rank, init_method))


def rank_worker(args, model_dir, rank: int, ready, heartbeat=None) -> None:
    """The server's process for tensor-parallel rank `rank` (not 0): report readiness (or
    why it could not start) to the launcher, then follow rank 0 (utils/worker.py)."""
    import dataclasses

    def build(parent: ParentWatch) -> Serving:
        from minisgl.engine.threads import share_cpu_cores

        config = dataclasses.replace(args.engine_config, model=str(model_dir))
        share_cpu_cores(config.device)  # as the scheduler (rank 0) does
        scheduler = _join(config, args.scheduler_config, rank, args.dist_init_method)
        return Serving(functools.partial(_follow, scheduler), {"rank": rank})

    # a rank blocked in a collective notices nothing: the harness's watchdog thread exits
    # with the parent
    run_worker(f"rank-{rank}", f"rank {rank}", args.log_level, build, ready, heartbeat)
