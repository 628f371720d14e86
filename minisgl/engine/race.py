"""The native decode step or torch's: whichever is faster on this machine, measured at start-up.

Why: the native step (models/native.py) saves torch's cost per operator, but its kernel is
plain C where the CPU has neither AVX2 nor AVX-512, and runs on one thread where it was
built without OpenMP (Apple's clang); there torch's int4 kernel can be the faster one.
Being available is not being faster, so the engine races the two on the model's own shapes
before it serves (engine/build.py).

Contract:
- `race(paths, rounds, clock)`: `paths` maps a name to a callable that runs one step; each
  runs once unmeasured (first-touch costs), then `rounds` times, the paths taking turns so
  that a noisy moment hits both alike. Returns each path's best time in seconds.
- `pick(times)` -> (the fastest path's name, one line with the figures).
- `decode_steps(engine, native, batch)`: the two paths of one decode step of `batch` tokens,
  on torch's thread count as it stands (the thread chooser, threads.py, is left to measure
  the steps it serves: a race step would count among them), every row writing its K/V to
  the pool's scratch page and reading a one-token sequence from it, as a graph's padding
  rows do: no request's pages are touched.
- `race_decode(engine, native)`: both paths over a one-token step -> (winner,
  line). Three steps of each: tens of milliseconds at start-up for the embedded model
  (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl.attention import AttentionContext, ForwardInfo

if TYPE_CHECKING:
    from minisgl.models.native import NativeDecoder

    from .engine import Engine

BATCH = 1  # the step raced: one token, what a lone request's every step is
ROUNDS = 2


def race(
    paths: dict[str, Callable[[], object]],
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    for step in paths.values():
        step()  # unmeasured: first-touch costs
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds):
        for name, step in paths.items():
            started = clock()
            step()
            best[name] = min(best[name], clock() - started)
    return best


def pick(times: dict[str, float]) -> tuple[str, str]:
    winner = min(times, key=times.__getitem__)
    figures = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items())
    return winner, f"{winner} is faster here ({figures})"


def decode_steps(
    engine: Engine, native: NativeDecoder, batch: int
) -> dict[str, Callable[[], object]]:
    ps, scratch = engine.page_size, engine.pool.scratch_page
    ids = torch.zeros(batch, dtype=torch.int64)
    info = ForwardInfo(
        positions=torch.zeros(batch, dtype=torch.int64),
        out_slots=torch.full((batch,), scratch * ps, dtype=torch.int64),
        block_table=torch.full((batch, 1), scratch, dtype=torch.int32),
        seq_lens=torch.ones(batch, dtype=torch.int32),
        extend_lens_cpu=[1] * batch,
        cached_lens_cpu=[0] * batch,
    )
    backend, model = engine.attn_backend, engine.model

    @torch.inference_mode()
    def native_step():
        return native.logits(native.forward(ids, info))

    @torch.inference_mode()
    def torch_step():
        ctx = AttentionContext(backend, backend.prepare(info))
        return model.logits(model(ids, info.positions, ctx))

    return {"native": native_step, "torch": torch_step}


def race_decode(engine: Engine, native: NativeDecoder) -> tuple[str, str]:
    winner, line = pick(race(decode_steps(engine, native, BATCH)))
    return winner, f"{line}, a decode step of {BATCH} token, best of {ROUNDS}"
