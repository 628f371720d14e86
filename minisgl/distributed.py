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
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


_tp = TPInfo()
_cpu_group = None  # gloo group for Python objects (scheduling decisions, state)


def tp() -> TPInfo:
    return _tp


def init_tp(rank: int, size: int, init_method: str, device_type: str = "cpu") -> TPInfo:
    """Join the process group of `size` ranks as `rank` (`init_method`: for example
    "tcp://127.0.0.1:29500", or "env://" to read MASTER_ADDR and MASTER_PORT)."""
    global _tp, _cpu_group
    import torch.distributed as dist

    if size > 1:
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # the other ranks wait in a broadcast for as long as rank 0 has nothing to do
        idle = timedelta(days=7)
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=size,
            rank=rank,
            timeout=idle if backend == "gloo" else None,
        )
        _cpu_group = dist.group.WORLD
        if backend != "gloo":
            _cpu_group = dist.new_group(backend="gloo", timeout=idle)
    _tp = TPInfo(rank, size)
    return _tp


def destroy_tp() -> None:
    global _tp, _cpu_group
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _tp, _cpu_group = TPInfo(), None


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

        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, info: TPInfo) -> torch.Tensor:
    """The ranks' `x` side by side along the last dimension (vocabulary-parallel logits)."""
    if info.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(info.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_(x: torch.Tensor, info: TPInfo, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place (the sampled tokens)."""
    if info.size > 1:
        import torch.distributed as dist

        dist.broadcast(x, src)
    return x


def min_over_ranks(n: int) -> int:
    """The smallest of the ranks' `n` (the KV pages every rank can hold)."""
    if _tp.size == 1:
        return n
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())


# ---------------------------------------------------------------- object collectives
def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass anything)."""
    if _tp.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
    if _tp.size == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * _tp.size if _tp.leader else None
    dist.gather_object(obj, out, dst=0, group=_cpu_group)
    return out
