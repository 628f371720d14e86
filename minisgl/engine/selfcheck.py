"""The start-up self-check of the CUDA fast path, and the fallbacks it decides.

Why: the Triton kernels, the CUDA graphs and overlap scheduling meet their hardware for the
first time on a user's GPU. A kernel the compiler refuses, a capture that allocates, a
stream-ordering bug that only real asynchrony shows: each is found here, before the first
request, and the engine serves on a slower but sound path instead of giving wrong tokens.

When: after the model loads, before the engine reports ready, on CUDA (where the fast path
runs). `MINISGL_SELF_CHECK_ON_CPU=1` runs the same code on a CPU engine (Triton kernels in
Triton's interpreter, nothing captured): it is the seam the tests drive, with faults
injected by the tests (tests/faults.py), and what `python -m minisgl doctor` uses on a CPU.
`EngineConfig.self_check`: "auto" checks and falls back; "strict" (--strict-self-check)
makes any failure fatal (`SelfCheckError`, start-up fails with the reason); "skip"
(--skip-self-check) checks nothing and catches nothing.

What, in order (each a list of `CheckResult`s in `results`):
1. attention: the backend in use against attention written out plainly in float32, on the
   engine's own pool at the model's shapes and dtype (attention/check.py). Triton failing:
   the torch backend is checked the same way and serves instead (without CUDA graphs,
   which only Triton's decode supports). The torch backend failing leaves nothing sound to
   serve with: start-up fails.
2. cuda_graph: capturing every decode bucket (an exception: eager decode, unless it left
   a sticky CUDA error, where nothing can run and start-up fails saying so), then each
   bucket's replay against the same step run eagerly, over real pages of the pool.
3. overlap: asked by the scheduler when it is about to overlap (`overlap_ok`): the tokens
   of a few greedy sequences decoded with overlapped steps against synchronous ones,
   exactly. A mismatch: synchronous steps.
A failure logs one error naming the part and the numbers and records the part's reason in
`engine.degraded` (part -> reason), which /health reports as `degraded` and /metrics as
`minisgl_engine_fallback{part=...}`. With tensor parallelism every rank checks its shard
and the ranks agree: one rank's failure is every rank's fallback.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import TYPE_CHECKING

import torch

from minisgl.attention import AttentionContext, ForwardInfo
from minisgl.attention.check import TOLERANCE, CheckResult, check_attention, first_line
from minisgl.distributed import STARTUP_TIMEOUT_S, barrier, broadcast_object, gather_objects
from minisgl.kvcache import pages_for

from .sequences import Sequences, consecutive_pages

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)

ON_CPU_ENV = "MINISGL_SELF_CHECK_ON_CPU"
MODES = ("auto", "strict", "skip")


class SelfCheckError(RuntimeError):
    """A failed self-check that may not fall back (--strict-self-check, or no sound path)."""


def runs_on(device: torch.device) -> bool:
    """Whether the start-up self-check runs for an engine on `device`."""
    return device.type == "cuda" or os.environ.get(ON_CPU_ENV, "") not in ("", "0")


class SelfCheck:
    def __init__(self, engine: Engine) -> None:
        if engine.config.self_check not in MODES:
            raise ValueError(f"self_check must be one of {', '.join(MODES)}")
        self.engine = engine
        self.strict = engine.config.self_check == "strict"
        self.enabled = engine.config.self_check != "skip" and runs_on(engine.device)
        self.results: list[CheckResult] = []
        self.seconds = 0.0
        self._overlap: bool | None = None  # the overlap check's verdict, once asked
        self._rounds = 0  # verdicts agreed between the ranks so far

    # ------------------------------------------------------------------ start-up
    def at_startup(self) -> None:
        """Check the attention backend, capture the decode graphs and check their replays."""
        engine = self.engine
        if not self.enabled:
            engine.capture_graphs()
            return
        started = time.perf_counter()
        self._check_attention()
        if engine.graph_runner is not None:
            try:
                engine.capture_graphs()
            except Exception as exc:
                engine.graph_runner = None
                capture = exception_result("cuda_graph capture", "cuda_graph", exc)
                if (dead := cuda_context_error(engine.device)) is not None:
                    # a sticky error (an illegal access, a device-side assert): every later
                    # CUDA call fails, so there is no eager path to fall back to either
                    self.results.append(capture)
                    raise SelfCheckError(
                        f"self-check: capturing the decode graphs failed ({capture.detail}) "
                        f"and left the CUDA context unusable: {dead}"
                    ) from exc
                self._record([capture], "eager decode steps (no CUDA graphs)")
            else:
                results = check_graphs(engine)
                if self._record(results, "eager decode steps (no CUDA graphs)"):
                    engine.graph_runner = None
        self.seconds += time.perf_counter() - started

    def _check_attention(self) -> None:
        engine = self.engine
        backend = engine.attn_backend
        name = "triton" if type(backend).__name__ == "TritonBackend" else "torch"
        results = check_attention(backend, name, **self._attention_sizes())
        if name == "torch":  # nothing to fall back to
            self._record(results, None)
            return
        if not self._failures(results):
            self.results += results
            return
        if self.strict:
            self._record(results, None)
        from minisgl.attention.torch_backend import TorchBackend

        fallback = TorchBackend(engine.pool, backend.num_heads, backend.head_dim)
        checked = check_attention(fallback, "torch", **self._attention_sizes())
        self.results += checked
        if self._failures(checked):
            self.results += results
            raise SelfCheckError(
                "self-check: neither attention backend is sound on this device: "
                f"{_first_failure(results).describe()}; {_first_failure(checked).describe()}"
            )
        errors = "/".join(f"{r.max_error:.2g}" for r in checked if r.max_error is not None)
        engine.use_attention_backend(fallback)
        self._record(results, f"the torch attention backend (checked: max errors {errors})")

    def _attention_sizes(self) -> dict:
        """Lengths that exercise split-KV on a GPU; short ones in Triton's interpreter."""
        if self.engine.device.type == "cuda":
            return {"decode_batches": (1, 7), "max_len": 2048}
        return {"decode_batches": (1, 3), "max_len": 48}

    # ------------------------------------------------------------------ overlap
    def overlap_ok(self) -> bool:
        """Whether overlapped steps give the synchronous steps' tokens (checked once)."""
        if self._overlap is None:
            self._overlap = True
            if self.enabled:
                started = time.perf_counter()
                failed = self._record([check_overlap(self.engine)], "synchronous steps")
                self._overlap = not failed
                self.seconds += time.perf_counter() - started
        return self._overlap

    # ------------------------------------------------------------------ verdicts
    def _failures(self, results: list[CheckResult]) -> list[str]:
        """The failures of `results` on any rank (the same list on every rank)."""
        failures = [r.describe() for r in results if not r.passed]
        tp = self.engine.tp
        if tp.size == 1:
            return failures
        # the ranks may be seconds apart (a kernel compiles slower on one): meet first, with
        # the start-up bound, then gather within the collectives' own
        self._rounds += 1
        barrier(f"self-check/{self._rounds}", STARTUP_TIMEOUT_S)
        gathered = gather_objects(failures)
        if tp.leader:
            failures = [f"rank {i}: {f}" for i, fs in enumerate(gathered) for f in fs]
        return broadcast_object(failures)

    def _record(self, results: list[CheckResult], fallback: str | None) -> bool:
        """Keep `results`; on a failure (on any rank) log it and fall back to `fallback`
        (None: there is none) or, when strict, raise. Returns whether anything failed."""
        self.results += results
        failures = self._failures(results)
        if not failures:
            return False
        part = next((r.part for r in results if not r.passed), results[0].part)
        reason = failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")
        if self.strict or fallback is None:
            why = "--strict-self-check" if self.strict else "nothing to fall back to"
            raise SelfCheckError(f"self-check failed ({why}): {reason}")
        logger.error("self-check failed: %s; falling back to %s", reason, fallback)
        self.engine.degraded[part] = f"{reason}; serving with {fallback}"
        return True

    def summary(self) -> str:
        """For the engine's start-up line."""
        if not self.enabled:
            return "self-check skipped" if self.engine.config.self_check == "skip" else ""
        passed = sum(r.passed for r in self.results)
        line = f"self-check: {passed}/{len(self.results)} checks passed in {self.seconds:.2f} s"
        if self.engine.degraded:
            line += f", fell back from {', '.join(self.engine.degraded)}"
        return line


# ---------------------------------------------------------------------------- the checks
def exception_result(name: str, part: str, exc: BaseException, seconds: float = 0.0) -> CheckResult:
    detail = f"{type(exc).__name__}: {first_line(exc)}"
    return CheckResult(name, part, False, detail=detail, seconds=seconds)


def cuda_context_error(device: torch.device) -> str | None:
    """None while `device` still computes; else the error that says why not. After a sticky
    CUDA error every call in the process fails with it, however small."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"
    return None


def _first_failure(results: list[CheckResult]) -> CheckResult:
    return next(r for r in results if not r.passed)


def _decode_layout(engine: Engine, bs: int) -> list[int]:
    """Lengths of the rows of a `bs`-row decode step over real pages: up to three pages
    each, ending mid-page and on a page; rows the pool has no pages for are padding (0)."""
    ps, free = engine.page_size, engine.num_pages
    lens = []
    for r in range(bs):
        n = 1 + (r * 7 + bs) % (3 * ps)
        pages = pages_for(n, ps)
        lens.append(n if pages <= free else 0)
        free -= pages if pages <= free else 0
    return lens


@torch.inference_mode()
def check_graphs(engine: Engine) -> list[CheckResult]:
    """Each bucket's replay (eager through the same buffers where nothing was captured)
    against the same step run eagerly, over pages filled with random keys and values."""
    runner = engine.graph_runner
    assert runner is not None
    buf, pool, ps = runner.buffers, engine.pool, engine.page_size
    device = engine.device
    tol = TOLERANCE.get(engine.dtype, 3e-2)
    captured = bool(runner.graphs)
    how = "replayed" if captured else "nothing captured on a CPU: the graph buffers run eagerly"
    gen = torch.Generator(device=device).manual_seed(0)
    ids_gen = torch.Generator().manual_seed(0)
    results = []
    for bs in runner.buckets:
        started = time.perf_counter()
        name = f"cuda_graph bs={bs}"
        try:
            lens = _decode_layout(engine, bs)
            real = sum(n > 0 for n in lens)
            table = torch.full((bs, buf.block_table.shape[1]), pool.scratch_page, dtype=torch.int32)
            first = consecutive_pages(table, lens, ps)  # pages used, from page 0
            pos = torch.tensor([max(n - 1, 0) for n in lens])
            slots = table[torch.arange(bs), pos // ps].long() * ps + pos % ps
            ids = torch.randint(0, engine.model_config.vocab_size, (bs,), generator=ids_gen)
            buf.block_table[:bs].copy_(table)
            buf.positions[:bs].copy_(pos)
            buf.out_slots[:bs].copy_(slots)
            buf.seq_lens[:bs].copy_(torch.tensor([max(n, 1) for n in lens], dtype=torch.int32))
            buf.input_ids[:bs].copy_(ids)
            region = slice(0, first * ps)
            pool.k[:, region].normal_(generator=gen)
            pool.v[:, region].normal_(generator=gen)
            info = ForwardInfo(
                buf.positions[:bs], buf.out_slots[:bs], buf.block_table[:bs],
                buf.seq_lens[:bs], [1] * bs, [max(n - 1, 0) for n in lens],
            )  # fmt: skip
            backend = runner.backend
            ctx = AttentionContext(backend, backend.prepare(info))
            hidden = engine.model(buf.input_ids[:bs], buf.positions[:bs], ctx)
            expected = engine.model.logits(hidden)[:real]
            got = runner.replay(bs)[:real]
            scale = max(1.0, expected.abs().max().item())
            err = (got - expected).abs().max().item() / scale
        except Exception as exc:
            results.append(exception_result(name, "cuda_graph", exc, time.perf_counter() - started))
            continue
        detail = f"{real} rows, {how}; error relative to the largest logit"
        results.append(
            CheckResult(name, "cuda_graph", err <= tol, err, tol, detail,
                        time.perf_counter() - started, {"batch_size": bs, "captured": captured})
        )  # fmt: skip
    return results


def check_overlap(engine: Engine) -> CheckResult:
    """Greedy tokens of a few sequences, each step launched before the previous step's
    tokens are read, against the same sequences stepped synchronously."""
    started = time.perf_counter()
    rng = random.Random(0)
    vocab, ps = engine.model_config.vocab_size, engine.page_size
    n = min(3, engine.config.max_running_requests)
    prompts = [[rng.randrange(vocab) for _ in range(k)] for k in (5, 2 * ps + 3, 9)[:n]]
    max_new = 5
    try:
        seqs = Sequences(engine, prompts, max_new)
        synchronous = seqs.generate(overlap=False)
        overlapped = seqs.generate(overlap=True)
    except Exception as exc:
        return exception_result("overlap", "overlap", exc, time.perf_counter() - started)
    wrong = [
        (i, j, a, b)
        for i, (x, y) in enumerate(zip(overlapped, synchronous))
        for j, (a, b) in enumerate(zip(x, y))
        if a != b
    ]
    detail = f"{n} sequences x {max_new} greedy tokens"
    if wrong:
        i, j, a, b = wrong[0]
        detail += f"; first difference: sequence {i} token {j}: {a} overlapped, {b} synchronous"
    return CheckResult(
        "overlap", "overlap", not wrong, float(len(wrong)), 0.0, detail,
        time.perf_counter() - started, {"sequences": n, "tokens": max_new}, "tokens differing",
    )  # fmt: skip
