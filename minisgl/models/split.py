"""A step's large quantized matmuls on two threads: the input rows cut in two.

Contract:
- `by_rows(fn, x)` is `fn(x)` for a row-wise `fn` (a matmul: output row i depends on input
  row i only), with the second half of x's rows done on a helper thread while the calling
  thread does the first; the halves are joined in order. The values are those of `fn(x)`
  when `fn` computes each row the same whatever the rows around it: true of the CPU int4
  kernel bit for bit (tests/unit/test_quantization.py), of a GEMM up to its summation order.
- `helper_thread_pays(device, tp_size)`: the case it is built for, a CPU scheduler whose
  torch computes on one thread (two cores: the API server and the tokenizer worker need the
  other, see minisgl.scheduler.io.share_cpu_cores), in a process alone in its group.
- `worth_splitting(rows, weight_elements)`: a matmul smaller than `SPLIT_WORK` multiply-adds
  stays on one thread, where handing half to the helper (a thread wake-up, about 50 us on a
  2-core VM) costs more than it saves; so does a single row (a batch-1 decode).

Why a thread and not torch's own second thread: torch's compute threads spin-wait on each
other at each of a step's thousands of operators, and when another process takes the second
core the whole step stalls (measured: 5.5x to 8.4x slower). Here only the big operators of a
batched step (decoding many requests, or a prefill) are cut in two; the helper sleeps on a
queue between them and never spins. When the other core is busy the helper's half simply
runs later, so the worst case is about the one-thread time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

# Measured at 16 rows on a 2-core AMD EPYC (one torch thread each): the 3072 x 576 gate/up
# projection 380 -> 275 us, the 49,152 x 576 LM head 12.2 -> 6.5 ms; the 960 x 576 q/k/v one
# (9M multiply-adds) 128 -> 148 us, slower. So from 16M on.
SPLIT_WORK = 1 << 24

_helper: tuple[int, ThreadPoolExecutor] | None = None  # (pid, its one thread)
_helper_lock = threading.Lock()


def _helper_thread() -> ThreadPoolExecutor:
    """This process's helper thread, made on first use (a forked child makes its own)."""
    global _helper
    with _helper_lock:
        if _helper is None or _helper[0] != os.getpid():
            _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="minisgl-matmul"))
        return _helper[1]


def helper_thread_pays(device: torch.device, tp_size: int) -> bool:
    """Whether a second core is there for the taking: a CPU, one torch compute thread, one
    rank (tensor-parallel ranks already share the cores among themselves)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return device.type == "cpu" and tp_size == 1 and torch.get_num_threads() == 1 and cores > 1


def worth_splitting(rows: int, weight_elements: int) -> bool:
    return rows > 1 and rows * weight_elements >= SPLIT_WORK


def _in_mode(fn: Callable, x: torch.Tensor, inference: bool) -> torch.Tensor:
    with torch.inference_mode(inference):  # grad modes are per thread: take the caller's
        return fn(x)


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x of shape (M, K), rows [M // 2:] on the helper thread."""
    h = x.shape[0] // 2
    later = _helper_thread().submit(_in_mode, fn, x[h:], torch.is_inference_mode_enabled())
    try:
        first = fn(x[:h])
    finally:
        second = later.result()  # waited for even when this thread's half failed
    return torch.cat([first, second])
