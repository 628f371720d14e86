"""Turn a first-contact run (benchmarks/first_contact.py's steps.jsonl) into a markdown
table: one row per step (status, seconds, the figure or the failure), then a row per failed
check, to copy into benchmarks/RESULTS.md.

Contract: standard library only; `table(path)` returns the markdown and never raises on a
run that was cut short (a missing or half-written file is a row saying so).

    python3 benchmarks/results_table.py gpu-results/steps.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> list[dict]:
    """The lines of steps.jsonl that parse (a cut run may end mid-line)."""
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue
    return lines


def _check_error(c: dict) -> str:
    return f"max error {c['max_error']:.3g}" if c.get("max_error") is not None else "raised"


def figure(step: str, records: list[dict]) -> tuple[str, list[dict]]:
    """What a step's records say, in one cell, and the failed checks among them."""
    checks = [r["check"] for r in records if "check" in r]
    for r in records:
        checks += r.get("engine", {}).get("checks", []) + r.get("overlap", {}).get("checks", [])
    failed = [c for c in checks if not c.get("passed")]
    parts = []
    for r in records:
        if env := r.get("environment"):
            dev = env["device"]
            mem = f", {dev['memory_gib']} GiB" if "memory_gib" in dev else ""
            driver = f", driver {dev['driver']}" if dev.get("driver") else ""
            parts.append(f"{dev.get('name')}{mem}{driver}; torch {env['torch']}, "
                         f"CUDA {env['cuda']}, triton {env['triton']}")  # fmt: skip
        if e := r.get("engine"):
            m = e.get("memory") or {}
            before, after = m.get("before_capture"), m.get("after_capture")
            cap = ""
            if before and after:
                cap = (f"; capture {e['capture_seconds']} s, free {before['free_gib']} -> "
                       f"{after['free_gib']} GiB")  # fmt: skip
            parts.append(f"{e['startup_line']}; {e['self_check']}{cap}")
        if o := r.get("overlap"):
            parts.append(f"overlap {'ok' if o['ok'] else 'FAILED: synchronous steps'}")
        if "throughput" in r:
            t, graphs = r["throughput"], "graphs on" if r.get("cuda_graph") else "graphs off"
            if t is None:
                why = "; ".join(n["reason"] for n in r.get("not_checked", []))
                parts.append(f"{graphs}: no figure ({why})")
            else:
                p, d = t["prefill"], t["decode"]
                parts.append(f"{graphs}: prefill {p['tokens_per_s']:,.0f} tok/s, decode "
                             f"{d['tokens_per_s']:,.0f} tok/s ({d['ms_per_step']:.2f} ms/step)")  # fmt: skip
        if off := r.get("offline.json"):
            for res in off.get("results", []):
                parts.append(f"offline {res['engine']}: {res['output_tokens']} tokens in "
                             f"{res['seconds']:.1f} s, {res['tok_per_s']:,.0f} output tok/s")  # fmt: skip
        if "passed" in r and "seconds" in r:  # the doctor's verdict line
            parts.append(f"doctor: {'all passed' if r['passed'] else 'FAILED'}")
        if "device_ok" in r:
            parts.append(f"{r['device']} computes" if r["device_ok"] else "device BROKEN")
        if err := r.get("error"):
            parts.append(err)
    if checks:
        parts.insert(0, f"{len(checks) - len(failed)}/{len(checks)} checks passed")
    return "; ".join(parts), failed


def table(path: Path) -> str:
    rows = ["| step | status | seconds | result |", "| --- | --- | --- | --- |"]
    try:
        lines = read(path)
    except OSError as exc:
        return "\n".join([*rows, f"| (none) | no result ({type(exc).__name__}) | | |"])
    head = next((x for x in lines if x["step"] == "run" and x["event"] == "start"), {})
    failures = []
    steps = list(dict.fromkeys(x["step"] for x in lines if x["step"] != "run"))
    for step in steps:
        records = [x["record"] for x in lines if x["step"] == step and x["event"] == "record"]
        end = next((x for x in lines if x["step"] == step and x["event"] == "end"), None)
        cell, failed = figure(step, records)
        if end is None:
            status, seconds = "running when the run ended", ""
        else:
            status, seconds = end["status"], end.get("seconds", "")
            if end["status"] == "timeout":
                status += f" ({' then '.join(end['signals'])} at {end['limit_s']} s)"
            elif end["status"] == "skipped":
                status += f" ({end['reason']})"
            elif end["status"] == "failed" and not cell and end.get("tail"):
                cell = end["tail"][-1]
            if end.get("cuda_error"):
                cell = f"CUDA error: {end['cuda_error']}; {cell}"
            if step == "gpu_tests" and end.get("tail"):
                cell = end["tail"][-1].strip("= ")  # pytest's summary line
        rows.append(f"| {step} | {status} | {seconds} | {cell.replace('|', '/')} |")
        failures += [(step, c) for c in failed]
    for step, c in failures:
        rows.append(f"| {step} FAILED | {c['name']}: {_check_error(c)} | | "
                    f"{str(c.get('detail', ''))[:160].replace('|', '/')} |")  # fmt: skip
    what = "dry run on the CPU" if head.get("dry_run") else "GPU"
    return f"First contact ({what}, commit {head.get('commit')})\n\n" + "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-results/steps.jsonl")))
