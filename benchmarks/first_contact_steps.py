"""The measuring steps of benchmarks/first_contact.py, one per process.

Contract: `python benchmarks/first_contact_steps.py STEP [--dry-run]` runs one step and
prints each result as one JSON object per line on stdout the moment it exists (flushed);
anything else it prints is log. It exits 0 when the step ran, 1 when what it checked
failed; a crash is a traceback and a non-zero status. The runner (first_contact.py) gives
each step its own process and time limit, so a hung kernel or a sticky CUDA error ends with
its step.

Steps:
- `env`: the device (name, memory, free memory), the driver, torch/Triton/CUDA versions;
- `attention`: the Triton attention kernels against float32 attention at Qwen3-0.6B's
  shape (16 query heads over 8 KV heads of 128, pages of 16), bfloat16 and float16;
- `engine`: an engine at Qwen3-0.6B's real configuration over random weights, as the
  server starts one (KV pool sized from free memory, every decode graph bucket captured,
  the start-up self-check on): its start-up line, the self-check's results, and device
  memory before the load, before the graph capture and after it;
- `overlap`: the same engine's overlap check (overlapped steps' tokens against synchronous
  ones);
- `throughput`: prefill and decode tokens per second (the doctor's probe), with CUDA
  graphs on and off.
`--dry-run` runs the same code on the CPU at the doctor's small CPU shapes (the attention
check in Triton's interpreter, the engines on the torch backend with the self-check through
its CPU seam), in seconds: how the runner is tested.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
QWEN3_ATTENTION = dict(num_heads=16, num_kv_heads=8, head_dim=128, page_size=16)
PROBE_SECONDS = {"cuda": 4.0, "cpu": 0.2}  # prefill, then decode; graphs on, then off


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def device_memory(torch, device) -> dict | None:
    """GiB free on the device, and held by this process's allocator (None on a CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    gib = 2**30
    return {
        "free_gib": round(free / gib, 2),
        "total_gib": round(total / gib, 2),
        "allocated_gib": round(torch.cuda.memory_allocated(device) / gib, 2),
        "reserved_gib": round(torch.cuda.memory_reserved(device) / gib, 2),
    }


def step_env(torch, device, dry: bool) -> int:
    from minisgl.doctor.checks import environment

    env = environment(device)
    env["memory"] = device_memory(torch, device)
    emit({"environment": env})
    return 0


def step_attention(torch, device, dry: bool) -> int:
    from minisgl.attention import create_attention_backend
    from minisgl.attention.check import check_attention
    from minisgl.doctor.checks import interpreter_computes
    from minisgl.kvcache import KVCachePool

    s = dict(QWEN3_ATTENTION)
    if dry:  # the interpreter runs every program in Python: the doctor's CPU shape
        s.update(num_heads=4, num_kv_heads=2, head_dim=16)
    sizes = (
        {"decode_batches": (1, 7, 64, 256), "max_len": 4096}
        if device.type == "cuda"
        else {"decode_batches": (1, 3), "max_len": 40}
    )
    tokens = 65536 if device.type == "cuda" else 1024
    failed = False
    for dtype in (torch.bfloat16, torch.float16):
        if dry and (err := interpreter_computes(dtype)) is not None:
            emit({"not_checked": {"name": f"triton {dtype}", "reason": "this Triton's "
                  f"interpreter computes tl.dot on it wrongly (off by {err:.3g})"}})  # fmt: skip
            continue
        pool = KVCachePool(
            1, tokens // s["page_size"], s["page_size"], s["num_kv_heads"], s["head_dim"],
            dtype, device,
        )  # fmt: skip
        backend = create_attention_backend("triton", pool, s["num_heads"], s["head_dim"], device)
        for result in check_attention(backend, "triton", **sizes):
            emit({"check": result.as_dict()})
            failed |= not result.passed
        del backend, pool
    return 1 if failed else 0


def _engine_config(device, dry: bool, model_dir: Path, **overrides):
    from minisgl.engine.config import EngineConfig

    if dry:  # the torch backend: in Triton's interpreter the self-check alone takes seconds
        cpu = dict(page_size=4, num_pages=64, max_running_requests=4, max_seq_len=64)
        return EngineConfig(model=str(model_dir), device="cpu", dummy_weights=True,
                            attention_backend="torch", **cpu, **overrides)  # fmt: skip
    # the server's defaults: pool from free memory, 256 running (every graph bucket)
    return EngineConfig(model=str(CONFIGS / "qwen3-0.6b"), device="cuda",
                        dummy_weights=True, **overrides)  # fmt: skip


def _model_dir(tmp: str, dry: bool) -> Path:
    from minisgl.doctor.checks import ENGINE_MODEL, write_config

    if not dry:
        return CONFIGS / "qwen3-0.6b"
    return write_config(Path(tmp), {"num_hidden_layers": 2, **ENGINE_MODEL["cpu"]})


def step_engine(torch, device, dry: bool) -> int:
    from minisgl.engine.build import build_engine
    from minisgl.engine.engine import Engine

    memory = {"before_load": device_memory(torch, device)}
    capture_s: list[float] = []
    capture = Engine.capture_graphs

    def measured_capture(engine) -> None:  # memory on either side of the capture
        memory["before_capture"] = device_memory(torch, device)
        started = time.perf_counter()
        try:
            capture(engine)
        finally:
            capture_s.append(round(time.perf_counter() - started, 2))
            memory["after_capture"] = device_memory(torch, device)

    Engine.capture_graphs = measured_capture
    lines = _log_lines()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minisgl-first-") as tmp:
        engine = build_engine(_engine_config(device, dry, _model_dir(tmp, dry)))
    runner = engine.graph_runner
    results = engine.self_check.results
    emit({
        "engine": {
            "startup_line": next((m for m in lines if m.startswith("engine ready")), None),
            "self_check": engine.self_check.summary(),
            "log": lines,
            "seconds": round(time.perf_counter() - started, 2),
            "capture_seconds": capture_s[0] if capture_s else None,
            "num_pages": engine.num_pages,
            "page_size": engine.page_size,
            "buckets": runner.buckets if runner is not None else None,
            "graphs": sorted(runner.graphs) if runner is not None else [],
            "attention_backend": type(engine.attn_backend).__name__,
            "degraded": engine.degraded,
            "memory": memory,
            "checks": [r.as_dict() for r in results],
        }
    })  # fmt: skip
    return 1 if engine.degraded or not all(r.passed for r in results) else 0


def step_overlap(torch, device, dry: bool) -> int:
    from minisgl.engine.build import build_engine

    with tempfile.TemporaryDirectory(prefix="minisgl-first-") as tmp:
        engine = build_engine(_engine_config(device, dry, _model_dir(tmp, dry)))
    started = time.perf_counter()
    ok = engine.check_overlap()
    checks = [r.as_dict() for r in engine.self_check.results if r.part == "overlap"]
    emit({"overlap": {"ok": ok, "seconds": round(time.perf_counter() - started, 2),
                      "checks": checks, "degraded": engine.degraded}})  # fmt: skip
    return 0 if ok else 1


def step_throughput(torch, device, dry: bool) -> int:
    from minisgl.doctor import probe
    from minisgl.doctor.checks import ENGINE_MODEL

    if dry:  # the small CPU model of the doctor's engine checks, not SmolLM2's 30 layers
        shape = dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2,
                     **ENGINE_MODEL["cpu"])  # fmt: skip
        probe.WORKLOAD = {"cpu": (shape, "two-layer Qwen3", (2, 16), (4, 8), 8)}
    failed = False
    for graphs in (True, False):
        not_checked: list[dict] = []
        result = probe.run(device, 2 * PROBE_SECONDS[device.type], not_checked, cuda_graph=graphs)
        emit({"throughput": result, "cuda_graph": graphs, "not_checked": not_checked})
        failed |= result is None
    return 1 if failed else 0


def _log_lines() -> list[str]:
    """The engine's log messages from now on, in a list (and on stderr as usual)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("minisgl").addHandler(Keep(level=logging.INFO))
    return lines


STEPS = {
    "env": step_env,
    "attention": step_attention,
    "engine": step_engine,
    "overlap": step_overlap,
    "throughput": step_throughput,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=list(STEPS))
    p.add_argument("--dry-run", action="store_true", help="on the CPU, at small shapes")
    args = p.parse_args(argv)
    if args.dry_run:
        # before any kernel is defined: Triton's interpreter, the self-check's CPU seam
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("MINISGL_SELF_CHECK_ON_CPU", "1")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        emit({"error": "torch sees no CUDA device (use --dry-run on a CPU)"})
        return 1
    device = torch.device("cpu" if args.dry_run else "cuda")
    return STEPS[args.step](torch, device, args.dry_run)  # as the server runs it: no grad mode


if __name__ == "__main__":
    sys.exit(main())
