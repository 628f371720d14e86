"""`python -m minisgl doctor [--json]`: does the CUDA fast path work on this machine?

Contract: one command a user runs on their machine, and the last step of
benchmarks/first_contact.py. It prints the device, driver and torch/Triton/CUDA versions,
then runs the engine's self-check (engine/selfcheck.py) at several shapes (checks.py): the
attention backends at head dims 64 and 128, GQA ratios 1, 4 and 8, pages of 1 and 16
tokens, decode batches across the CUDA-graph buckets, in bfloat16 and float16; then, for a
small model in each dtype, the engine's own start-up check (attention at the model's
shape, every decode graph bucket, overlapped against synchronous steps); then a throughput
probe (probe.py, 10 s by default: prefill and decode tokens per second). A table on the
terminal (report.py), or with `--json` one object of the fixed shape
`{"checks": [{"name", "passed", ...}], "not_checked": [...], "environment": {...},
"throughput": {...}, "passed": bool}`, or with `--jsonl` the same as JSON lines written as
each part completes and flushed at once (`{"environment": ...}`, then `{"check": ...}` per
check, `{"not_checked": ...}`, `{"throughput": ...}`, last `{"passed", "seconds"}`): a run
cut short still leaves every check that finished. Exit status 0 when every check that ran
passed, 1 otherwise.

On a machine without CUDA it runs the same checks with Triton's interpreter
(TRITON_INTERPRET=1, where triton is installed) at smaller sizes, and lists under
`not_checked` what it could not check there (graph capture, real asynchrony, bfloat16
kernels where the interpreter cannot compute them).

Imports: torch, numpy, triton where installed, and the engine's modules; none of the
server's (FastAPI, uvicorn, pydantic, pyzmq). The engine checks and the probe need the
engine, whose messages need msgspec: without it they are listed as not checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl doctor",
        description="Check that minisgl's CUDA fast path (Triton attention, CUDA graphs, "
        "overlap scheduling) computes what it should on this machine, and how fast.",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object on stdout")
    out.add_argument(
        "--jsonl",
        action="store_true",
        help="JSON lines on stdout, each check as it completes (a cut run keeps what finished)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--probe-seconds",
        type=float,
        default=10.0,
        help="length of the throughput probe, prefill and decode together (0: none)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe_seconds < 0:
        build_parser().error("--probe-seconds must not be negative")
    import torch

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            build_parser().error("--device cuda: torch sees no CUDA device")
    if device.type != "cuda":
        # before any kernel is defined: Triton's interpreter runs them with numpy, and the
        # engine's self-check runs on a CPU through its documented seam
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("MINISGL_SELF_CHECK_ON_CPU", "1")
    from . import checks, probe, report

    started = time.perf_counter()
    env = checks.environment(device)
    lines = report.JsonLines(sys.stdout) if args.jsonl else None
    progress = lines.checks if lines else None if args.json else report.progress
    if lines:
        lines.write("environment", env)
    elif not args.json:
        report.header(env)
    doc = checks.run_all(device, env, progress=progress)
    if lines:
        lines.checks(doc["checks"])  # the last engine's, and any the progress calls missed
        for entry in doc["not_checked"]:
            lines.write("not_checked", entry)
    not_checked = len(doc["not_checked"])
    doc["throughput"] = probe.run(device, args.probe_seconds, doc["not_checked"])
    doc["passed"] = all(c["passed"] for c in doc["checks"])
    doc["seconds"] = round(time.perf_counter() - started, 2)
    if lines:
        for entry in doc["not_checked"][not_checked:]:  # the probe's reason, where it gave one
            lines.write("not_checked", entry)
        lines.write("throughput", doc["throughput"])
        lines.write(None, {"passed": doc["passed"], "seconds": doc["seconds"]})
    elif args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        report.summary(doc)
    return 0 if doc["passed"] else 1
