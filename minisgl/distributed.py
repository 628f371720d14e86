"""Tensor parallelism on torch.distributed: which rank this process is, and the few
collectives a sharded model and its scheduler need.

Contract: a process that is one of N ranks calls `init_tp(rank, size, init_method)`
once, before it builds its engine, which reads `tp()` (rank 0 of 1 when it never did) and
keeps it: the tensor collectives take that `TPInfo` and return at once for one rank, so a
single-device engine pays nothing, even one built in a process that later joins a group.
One process is in at most one group at a time. The tensor collectives (`all_reduce`,
`all_gather`, `broadcast_`) run on the model's device (NCCL on CUDA, gloo on the CPU); the object collectives (`broadcast_object`,
`gather_objects`) always run on a gloo group of their own, so the scheduler's messages
never go through a GPU. `shard(n)` is the part of n things (heads, rows) a rank owns;
`kv_heads()` is the part of the KV heads, replicated when there are fewer than ranks.
`destroy_tp()` tears the process group down.

No collective waits forever: every one times out after the group's `timeout` (a minute by
default), so a rank that dies or stops turns into an error (`RanksFailed`) on the others
instead of a hang. The other ranks wait for rank 0 between requests, which may be hours, so
they must not wait inside a collective then: rank 0 says "rest" before it waits for work,
and they sleep on the rendezvous store (`sleep_until_woken`) until its next collective
wakes them (`wake_followers`; both driven by the scheduler's `Ranks`, scheduler/ranks.py). `barrier(tag, timeout)`
lines the ranks up where they may be far apart (after each loaded its weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


class RanksFailed(RuntimeError):
    """A collective failed or timed out: another rank died or stopped. The group cannot
    compute together any more (gloo and NCCL raise plain RuntimeErrors; this names it)."""


def _ranks_failed(exc: Exception) -> RanksFailed:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RanksFailed(first)


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


_tp = TPInfo()
_cpu_group = None  # gloo group for Python objects (scheduling decisions, state)
_store = None  # the rendezvous store (rank 0 hosts it): rest periods, barriers

# how long ranks may take to meet at start-up (process start, imports, loading weights):
# far longer than any collective may wait once they run in step
STARTUP_TIMEOUT_S = 600.0


def tp() -> TPInfo:
    return _tp


def init_tp(
    rank: int, size: int, init_method: str, device_type: str = "cpu", timeout: float = 60.0
) -> TPInfo:
    """Join the process group of `size` ranks as `rank` (`init_method`: for example
    "tcp://127.0.0.1:29500", or "env://" to read MASTER_ADDR and MASTER_PORT). A collective
    that waits longer than `timeout` seconds for another rank raises RanksFailed."""
    global _tp, _cpu_group, _store
    import torch.distributed as dist

    if size > 1:
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # meet first, with all the time start-up needs; then every collective is bounded
        host, port = _address(init_method)
        _store = dist.TCPStore(
            host,
            port,
            size,
            is_master=rank == 0,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
            wait_for_workers=True,
        )
        bound = timedelta(seconds=timeout)
        dist.init_process_group(backend, store=_store, world_size=size, rank=rank, timeout=bound)
        _cpu_group = dist.group.WORLD
        if backend != "gloo":
            _cpu_group = dist.new_group(backend="gloo", timeout=bound)
    _tp = TPInfo(rank, size)
    return _tp


def _address(init_method: str) -> tuple[str, int]:
    if init_method == "env://":
        import os

        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must be tcp://HOST:PORT or env://, not {init_method!r}")
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def barrier(tag: str, timeout: float) -> None:
    """Wait (up to `timeout` s, far more than a collective's bound) until every rank got
    here: where ranks may be minutes apart, such as after loading their weights."""
    if _tp.size == 1:
        return
    store = _store
    store.set(f"minisgl/{tag}/{_tp.rank}", "1")
    keys = [f"minisgl/{tag}/{r}" for r in range(_tp.size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise _ranks_failed(exc) from exc


def wake_followers(rest: int) -> None:
    """Rank 0, after rest period `rest`: the other ranks stop sleeping on the store."""
    store = _store
    store.set(f"minisgl/wake/{rest}", "1")
    if rest > 1:  # every rank has passed the previous one: it is only litter now
        store.delete_key(f"minisgl/wake/{rest - 1}")


def sleep_until_woken(rest: int, alive=lambda: True) -> None:
    """A rank other than 0: sleep through rank 0's rest period `rest`; `alive()` is asked
    once a second (False: give up)."""
    store = _store
    key = f"minisgl/wake/{rest}"
    while alive():
        try:
            store.wait([key], timedelta(seconds=1))
            return
        except RuntimeError as exc:
            if "timeout" in str(exc).lower():  # not yet
                continue
            raise _ranks_failed(exc) from exc  # rank 0 (which hosts the store) is gone
    raise RanksFailed("this rank's parent went away while it waited for rank 0")


def destroy_tp() -> None:
    global _tp, _cpu_group, _store
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _tp, _cpu_group, _store = TPInfo(), None, None


# ---------------------------------------------------------------- sharding
def shard(n: int, info: TPInfo | None = None) -> tuple[int, int]:
    """(start, count) of the rank's equal part of `n` (n must divide evenly)."""
    info = info or _tp
    if n % info.size:
        raise ValueError(f"{n} does not split evenly across {info.size} ranks")
    count = n // info.size
    return info.rank * count, count


def kv_heads(num_kv_heads: int, info: TPInfo | None = None) -> tuple[int, int]:
    """(first head, count) of the KV heads this rank holds: an equal part, or with fewer
    heads than ranks, one head shared by `size / num_kv_heads` ranks."""
    info = info or _tp
    if num_kv_heads >= info.size:
        return shard(num_kv_heads, info)
    if info.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be shared by {info.size} ranks")
    return info.rank * num_kv_heads // info.size, 1


# ---------------------------------------------------------------- tensor collectives
def all_reduce(x: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """Sum `x` over the ranks of `info` (the model's), in place (row-parallel layers)."""
    if info.size > 1:
        import torch.distributed as dist

        try:
            dist.all_reduce(x)
        except RuntimeError as exc:
            raise _ranks_failed(exc) from exc
    return x


def all_gather(x: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """The ranks' `x` side by side along the last dimension (vocabulary-parallel logits)."""
    if info.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(info.size)]
    try:
        dist.all_gather(parts, x.contiguous())
    except RuntimeError as exc:
        raise _ranks_failed(exc) from exc
    return torch.cat(parts, dim=-1)


def broadcast_(x: torch.Tensor, info: TPInfo, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place (the sampled tokens)."""
    if info.size > 1:
        import torch.distributed as dist

        try:
            dist.broadcast(x, src)
        except RuntimeError as exc:
            raise _ranks_failed(exc) from exc
    return x


def min_over_ranks(n: int) -> int:
    """The smallest of the ranks' `n` (the KV pages every rank can hold)."""
    if _tp.size == 1:
        return n
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    except RuntimeError as exc:
        raise _ranks_failed(exc) from exc
    return int(t.item())


# ---------------------------------------------------------------- object collectives
def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass anything)."""
    if _tp.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    try:
        dist.broadcast_object_list(box, src=0, group=_cpu_group)
    except RuntimeError as exc:
        raise _ranks_failed(exc) from exc
    return box[0]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
    if _tp.size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * _tp.size if _tp.leader else None
    try:
        dist.gather_object(obj, out, dst=0, group=_cpu_group)
    except RuntimeError as exc:
        raise _ranks_failed(exc) from exc
    return out
