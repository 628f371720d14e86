"""The doctor's terminal report: one screen that answers "does the fast path work here?".

Contract: `header(env)` prints the machine; `progress(checks)` shows on a terminal how many
checks have run; `summary(doc)` prints one row per attention shape (a cell per check: ok or
FAIL and the max error), one line per engine check, the throughput, what was not checked,
every failure in full, and the verdict. `JsonLines` is `--jsonl`'s writer: one line per
part, flushed as it is written. Nothing here decides anything: the document built
by checks.py and probe.py is the result.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO


class JsonLines:
    """`--jsonl`: each result a JSON line, flushed at once, so a run cut short (a hung
    kernel, a time limit) still leaves every line written before."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.written = 0  # checks written so far

    def write(self, key: str | None, value) -> None:
        """`{key: value}`, or `value` itself (a dict) when key is None."""
        self.out.write(json.dumps(value if key is None else {key: value}) + "\n")
        self.out.flush()

    def checks(self, checks: list[dict]) -> None:
        """The checks of `checks` (every check so far, in order) not yet written."""
        for c in checks[self.written :]:
            self.write("check", c)
        self.written = max(self.written, len(checks))


def header(env: dict) -> None:
    dev = env["device"]
    if dev["type"] == "cuda":
        device = (
            f"{dev['name']} (compute {dev['capability']}, {dev['multiprocessors']} SMs, "
            f"{dev['memory_gib']} GiB), driver {dev['driver'] or 'unknown'}"
        )
    else:
        device = f"CPU {dev['name']} ({dev['cpus']} cores), no CUDA device"
    triton = f"triton {env['triton']}" if env["triton"] else "triton not installed"
    if env["triton"] and env["triton_interpreter"]:
        triton += " (interpreter: TRITON_INTERPRET=1)"
    cuda = f" built for CUDA {env['cuda']}" if env["cuda"] else " (CPU build)"
    print("minisgl doctor")
    print(f"  device    {device}")
    print(f"  software  Python {env['python']}, torch {env['torch']}{cuda}, {triton}")
    print()


def progress(checks: list[dict]) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r  {len(checks)} checks run...")
        sys.stderr.flush()


def _cell(checks: list[dict]) -> str:
    """ok/FAIL and the largest error of one check, or of several (graph buckets)."""
    ok = all(c["passed"] for c in checks)
    errors = [c["max_error"] for c in checks if c["max_error"] is not None]
    worst = f" {max(errors):.1e}" if errors else ""
    if not ok and len(errors) < len(checks):
        worst += " (raised)"
    count = f" x{len(checks)}" if len(checks) > 1 else ""
    return f"{'ok' if ok else 'FAIL'}{worst}{count}"


def _cells(group: list[dict]) -> dict[str, str]:
    by_name: dict[str, list[dict]] = {}
    for c in group:
        short = c["name"].split(": ", 1)[-1]
        if short.startswith("cuda_graph bs="):
            short = "cuda_graph"  # every bucket in one cell
        by_name.setdefault(short, []).append(c)
    return {name: _cell(cs) for name, cs in by_name.items()}


def summary(doc: dict) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 40 + "\r")
    groups: dict[str, list[dict]] = {}
    for c in doc["checks"]:
        groups.setdefault(c["group"], []).append(c)
    attention = {g: _cells(cs) for g, cs in groups.items() if g.startswith("attention ")}
    if attention:
        columns = list(dict.fromkeys(k for cells in attention.values() for k in cells))
        widths = [
            max(len(col), *(len(c.get(col, "")) for c in attention.values())) for col in columns
        ]
        first = max(len(g) for g in attention) - len("attention ")
        print("attention: max error against float32 attention (store: exact, so 0)")
        print(
            "  "
            + "shape".ljust(first)
            + "".join(f"  {c.ljust(w)}" for c, w in zip(columns, widths))
        )
        for group, cells in attention.items():
            row = "".join(f"  {cells.get(c, '-').ljust(w)}" for c, w in zip(columns, widths))
            print("  " + group.removeprefix("attention ").ljust(first) + row)
        print()
    engines = {g: _cells(cs) for g, cs in groups.items() if not g.startswith("attention ")}
    if engines:
        print("engine: the start-up self-check of a two-layer random model")
        for group, cells in engines.items():
            print(f"  {group}")
            print("    " + ", ".join(f"{name} {cell}" for name, cell in cells.items()))
        print()
    if (t := doc.get("throughput")) is not None:
        graphs = ", CUDA graphs" if t["cuda_graphs"] else ""
        overlap = ", overlapped steps" if t["overlap"] else ""
        print(f"throughput: {t['model']}, {t['dtype']}, {t['attention_backend']}{graphs}{overlap}")
        p, d = t["prefill"], t["decode"]
        print(
            f"  prefill  {p['batch']} x {p['prompt_tokens']} tokens: {p['tokens_per_s']:,.0f} tokens/s"
        )
        print(f"  decode   {d['batch']} sequences: {d['tokens_per_s']:,.0f} tokens/s "
              f"({d['ms_per_step']:.2f} ms per step)")  # fmt: skip
        print()
    if doc["not_checked"]:
        print("not checked")
        for n in doc["not_checked"]:
            print(f"  - {n['name']}: {n['reason']}")
        print()
    failed = [c for c in doc["checks"] if not c["passed"]]
    if failed:
        print("failed")
        for c in failed:
            numbers = (
                f"{c['measure']} {c['max_error']:.3g} > tolerance {c['tolerance']:.3g}"
                if c["max_error"] is not None and c["tolerance"] is not None
                else "raised"
            )
            print(f"  - {c['name']}: {numbers} ({c['detail']})")
        print()
    total = len(doc["checks"])
    if failed:
        print(f"{len(failed)} of {total} checks FAILED ({doc['seconds']:.1f} s): the server "
              "falls back from these parts (or, with --strict-self-check, refuses to start)")  # fmt: skip
    else:
        print(f"all {total} checks passed ({doc['seconds']:.1f} s)")
