"""A step's large operators on two threads: the input rows cut in two.

Contract:
- `by_rows(fn, *xs)` is `fn(*xs)` for a row-wise `fn` (a matmul, a block of layers, the
  attention of a batch of requests: output row i depends on the inputs' rows i only), with
  the second half of the rows done on a helper thread while the calling thread does the
  first; the halves are joined in order. Inside a half nothing splits again. The values
  are those of `fn(*xs)` when `fn` computes each row the same whatever the rows around it:
  true of the CPU int4 kernel bit for bit (tests/unit/test_quantization.py), of a GEMM and
  of SDPA up to float rounding (their blocking depends on the batch size).
- `both(first, second)` is `(first(), second())`, the second on the helper thread: two
  halves of one operator cut some other way (a weight's output columns).
- `helper_thread_pays(device)`: the case it is built for, a CPU scheduler whose torch
  computes on one thread (two cores: the API server and the tokenizer worker need the
  other, see minisgl.engine.threads.share_cpu_cores), in a process that is not one of several
  tensor-parallel ranks (those share the cores among themselves already).
- `worth_splitting(rows, work_per_row, threshold)`: work smaller than `threshold` (multiply-
  adds of the int4 kernel, `SPLIT_WORK` by default) stays on one thread, where handing half
  to the helper costs more than it saves; so does a single row (a batch-1 decode), anything
  inside a half, and any step while torch itself computes on more than one thread (the
  engine widens it where that measures faster: minisgl.engine.threads).

Why a thread and not torch's own second thread: torch's compute threads spin-wait on each
other at each of a step's thousands of operators, and when another process takes the second
core the whole step stalls (several times slower: benchmarks/RESULTS.md). Here only the big operators of a
batched step (decoding many requests, or a prefill) are cut in two; the helper sleeps on a
queue between them and never spins. When the other core is busy the helper's half simply
runs later, so the worst case is about the one-thread time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from minisgl.utils.process import usable_cores

# Multiply-adds from which handing half to the helper pays: a hand-over costs about as much
# as a small projection saves, the LM head and prefill chunks gain (benchmarks/RESULTS.md)
SPLIT_WORK = 1 << 26

_helper: tuple[int, ThreadPoolExecutor] | None = None  # (pid, its one thread)
_helper_lock = threading.Lock()
_inside = threading.local()  # .half set while a thread computes its half


def _helper_thread() -> ThreadPoolExecutor:
    """This process's helper thread, made on first use (a forked child makes its own).

    It computes on one torch thread: OpenMP's thread count belongs to each thread, and a
    new one starts at every core, so the helper's half ran on a team of its own whose
    threads then spun beside the caller's (batch-1 steps twice as slow once the helper had
    run)."""
    global _helper
    with _helper_lock:
        if _helper is None or _helper[0] != os.getpid():
            pool = ThreadPoolExecutor(
                1, "minisgl-matmul", initializer=torch.set_num_threads, initargs=(1,)
            )
            _helper = (os.getpid(), pool)
        return _helper[1]


def helper_thread_pays(device: torch.device) -> bool:
    """Whether a second core is there for the taking (see the module's contract)."""
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    one_thread = torch.get_num_threads() == 1
    return device.type == "cpu" and ranks == 1 and one_thread and usable_cores() > 1


def worth_splitting(rows: int, work_per_row: int, threshold: int | None = None) -> bool:
    if getattr(_inside, "half", False) or torch.get_num_threads() > 1:
        return False  # inside a half, or torch computes on several threads this step
    return rows > 1 and rows * work_per_row >= (SPLIT_WORK if threshold is None else threshold)


def _half(fn: Callable, xs: tuple, inference: bool | None = None) -> torch.Tensor:
    _inside.half = True
    try:
        if inference is None:
            return fn(*xs)
        with torch.inference_mode(inference):  # grad modes are per thread: the caller's
            return fn(*xs)
    finally:
        _inside.half = False


def by_rows(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn(*xs) for tensors of M rows each, rows [M // 2:] on the helper thread."""
    h = xs[0].shape[0] // 2
    first, second = both(partial(fn, *(x[:h] for x in xs)), partial(fn, *(x[h:] for x in xs)))
    return torch.cat([first, second])


def both(first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]):
    """(first(), second()), second() computed on the helper thread meanwhile."""
    inference = torch.is_inference_mode_enabled()
    later = _helper_thread().submit(_half, second, (), inference)
    try:
        mine = _half(first, ())
    finally:
        theirs = later.result()  # waited for even when this thread's half failed
    return mine, theirs
