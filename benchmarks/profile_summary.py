"""Summaries of a profile of one process of the frontend benchmark (benchmarks/frontend.py):
py-spy's raw collapsed stacks or a cProfile stats file, reduced to the functions with the
largest self and inclusive shares, with minisgl's own functions listed apart.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def frame_name(frame: str) -> str:
    """py-spy raw frame 'func (path/to/file.py:123)' -> 'path/to/file.py:func'."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    func, path = m.group(1), m.group(2)
    path = path.split("site-packages/")[-1]
    path = path.split(str(REPO) + "/")[-1]
    return f"{path}:{func}"


def summarize_collapsed(text: str, top: int = 30) -> dict:
    """Self and inclusive shares of the samples per function, from py-spy's raw output."""
    self_c, incl_c, total = Counter(), Counter(), 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [frame_name(f) for f in stack.split(";")]
        self_c[frames[-1]] += k
        for f in set(frames):
            incl_c[f] += k

    def share(c: Counter) -> list:
        return [(name, round(100 * v / total, 1)) for name, v in c.most_common(top)]

    ours = Counter({k: v for k, v in incl_c.items() if k.startswith("minisgl/")})
    return {
        "samples": total,
        "self_pct": share(self_c),
        "minisgl_inclusive_pct": share(ours),
        "inclusive_pct": share(incl_c),
    }


def summarize_pstats(path: str, top: int = 30) -> dict:
    import pstats

    st = pstats.Stats(path)
    total = st.total_tt
    rows = [
        (f"{file.split('site-packages/')[-1].split(str(REPO) + '/')[-1]}:{func}", nc, tt, ct)
        for (file, _line, func), (_cc, nc, tt, ct, _) in st.stats.items()
    ]

    def fmt(rs):
        return [
            (n, calls, round(100 * tt / total, 1), round(100 * ct / total, 1))
            for n, calls, tt, ct in rs
        ]

    by_self = sorted(rows, key=lambda r: -r[2])[:top]
    ours = sorted([r for r in rows if r[0].startswith("minisgl/")], key=lambda r: -r[3])[:top]
    return {
        "total_s": total,
        "columns": ["function", "calls", "self %", "inclusive %"],
        "self_pct": fmt(by_self),
        "minisgl_inclusive_pct": fmt(ours),
    }


def print_profile(profile: dict) -> None:
    who = profile.get("process", "api")
    rate = profile["rate"] or "burst"
    print(
        f"\nprofile of {who} ({profile['tool']}, {profile['concurrency']} streams at {rate} "
        f"chunks/s offered, {profile['seconds']:.0f} s; load meanwhile: {profile['load']})"
    )
    for key in ("self_pct", "minisgl_inclusive_pct"):
        if profile["tool"] == "py-spy":
            print(f"  -- {key.replace('_pct', '')}: % of samples, function")
            rows = [f"{pct:5.1f}  {name}" for name, pct in profile[key][:20]]
        else:
            print(f"  -- {key.replace('_pct', '')}: inclusive %, self %, calls, function")
            rows = [f"{c:5.1f} {t:5.1f} {n:8d}  {name}" for name, n, t, c in profile[key][:20]]
        for row in rows:
            print("    " + row)
