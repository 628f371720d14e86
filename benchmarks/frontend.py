"""Frontend benchmark: how fast minisgl's API server and tokenizer worker deliver streamed
chunks, against a bare uvicorn SSE server sending byte-identical chunks, in the same run
with the same client (benchmarks/README.md has the method and how to read the table).

- ours: the real API server and tokenizer worker, each in its own process, over the real
  ZMQ channels; a stand-in takes the scheduler's place (one token per running request per
  step, in one frame). /debug/lifecycle is checked back at zero after every point;
- bare: a plain ASGI app under the same uvicorn settings sending the bytes ours sends for
  one token per chunk (checked before measuring);
- the client: its own process, C httpx streams in a closed loop, counting content chunks
  and tokens over the raw bytes; `--warmup` tokens, then `--tokens` timed.

Ours is measured in burst (the stand-in as fast as it can: the frontend coalesces) and at
its paced capacity (`Bench.capacity`: the highest rate kept at one token per chunk). With
`--pin auto` the server under test runs alone on core 0. `--profile py-spy` samples one of
our processes afterwards. The processes are frontend_stack.py's; the measurements, the
table and the profile summary are here.

    python benchmarks/frontend.py                                  # 1, 16 and 64 streams
    python benchmarks/frontend.py --concurrency 64 --no-capacity --profile py-spy
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from common import add_quiet_flags, quiet_first, script_parser, write_json
from frontend_stack import (
    WORD,
    chat_request,
    client_main,
    run_tokenizer,
    serve_bare,
    serve_ours,
    standin_scheduler,
)

from minisgl.testing.server import free_port, is_zero, wait_healthy

REPO = Path(__file__).resolve().parent.parent
CAPACITY_START, CAPACITY_TRIALS = 1000.0, 9  # chunks/s offered first; trials at most
KEPT_UP_TOKENS_PER_CHUNK = 1.1


def say(line: str) -> None:
    print(line, flush=True)  # a run takes minutes


def uvicorn_impls(loop: str, http: str) -> tuple[str, str]:
    """Resolve uvicorn's "auto" as uvicorn does, so the report names what ran."""
    import importlib.util

    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def wait_lifecycle_zero(url: str, timeout: float = 15.0) -> dict:
    """After a point (whose streams were cancelled mid-way): every component at zero."""
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/debug/lifecycle", timeout=5).json()
        if is_zero(state):  # the tests' criterion (minisgl.testing.server)
            return state
        if time.monotonic() > deadline:
            raise SystemExit(f"state left behind after a point: {state}")
        time.sleep(0.1)


def normalize_stream(data: bytes) -> bytes:
    data = re.sub(rb"chatcmpl-[0-9a-f]{32}", b"chatcmpl-ID", data)
    return re.sub(rb'"created":\d+', b'"created":T', data)


def check_identical(ours: str, bare: str, step_s, max_tokens: int = 4, tries: int = 5) -> dict:
    """Ours (paced, so one token per chunk) and bare send the same bytes, ids and times
    aside, and the same header names. On a busy machine ours may still coalesce two tokens
    (then it is tried again)."""
    body = chat_request(max_tokens)
    b = httpx.post(bare + "/v1/chat/completions", json=body, timeout=30)
    step_s.value = 0.05
    try:
        for _ in range(tries):
            o = httpx.post(ours + "/v1/chat/completions", json=body, timeout=30)
            if normalize_stream(o.content) == normalize_stream(b.content):
                break
    finally:
        step_s.value = 0.0
    if normalize_stream(o.content) != normalize_stream(b.content):
        raise SystemExit(f"ours and bare differ:\n{o.content!r}\n{b.content!r}")
    return {"identical_body": True, "same_header_names": set(o.headers) == set(b.headers),
            "body_bytes": len(o.content), "max_tokens": max_tokens}  # fmt: skip


def brief(res: dict) -> dict:
    """The figures of a measurement kept for a capacity trial or the profile's load."""
    keys = ("tokens_per_s", "chunks_per_s", "tokens_per_chunk", "emitted_per_s", "cpu_pct",
            "others_cpu_pct")  # fmt: skip
    return {k: res[k] for k in keys}


# ============================================================================ the run
class Bench:
    """The processes of one run and the measurements made with them."""

    def __init__(self, args) -> None:
        self.args = args

    def start(self) -> None:
        from minisgl.models.source import resolve_model_dir
        from minisgl.server.args import ServerArgs
        from minisgl.tokenizer.tokenize import load_tokenizer
        from minisgl.utils.zmq import IpcChannels

        a = self.args
        model_dir = resolve_model_dir(None)
        ids = load_tokenizer(model_dir).encode(WORD, add_special_tokens=False)
        assert len(ids) == 1, f"{WORD!r} is not one token: {ids}"
        self.loop, self.http = uvicorn_impls(a.loop, a.http)
        self.ncpu = os.cpu_count() or 1
        self.server_cpus = {0} if a.pin == "auto" and self.ncpu >= 2 else None
        self.other_cpus = set(range(1, self.ncpu)) if self.server_cpus else None
        ctx = mp.get_context("spawn")
        self.channels = IpcChannels.create()
        self.procs: list = []
        self.conn = None
        self.step_s = ctx.RawValue("d", 0.0)
        self.emitted = ctx.RawValue("q", 0)

        def start(target, name, *targs):
            p = ctx.Process(target=target, args=targs, name=name, daemon=True)
            p.start()
            self.procs.append(p)
            return p

        ours_port, bare_port = free_port(), free_port()
        self.ours_url = f"http://127.0.0.1:{ours_port}"
        self.bare_url = f"http://127.0.0.1:{bare_port}"
        r_tok, s_tok = ctx.Pipe(duplex=False)
        r_sch, s_sch = ctx.Pipe(duplex=False)
        wargs = ServerArgs(log_level="warning")
        self.tokenizer = start(run_tokenizer, "tokenizer", wargs, model_dir, self.channels, s_tok,
                               self.other_cpus)  # fmt: skip
        self.standin = start(standin_scheduler, "standin", self.channels, ids[0], self.step_s,
                             self.emitted, s_sch, self.other_cpus)  # fmt: skip
        for r in (r_tok, r_sch):
            status, info = r.recv()
            if status != "ready":
                raise SystemExit(info)
        self.api = start(serve_ours, "api-server", ours_port, self.channels, self.loop, self.http,
                         self.server_cpus)  # fmt: skip
        self.bare = start(serve_bare, "bare-server", bare_port, self.loop, self.http,
                          self.server_cpus)  # fmt: skip
        self.conn, child = ctx.Pipe()
        self.client = start(client_main, "client", child, self.emitted, self.other_cpus)
        dead = lambda: any(not p.is_alive() for p in self.procs)  # noqa: E731
        for url in (self.ours_url, self.bare_url):
            if not wait_healthy(url, dead, 300.0):
                exits = {p.name: p.exitcode for p in self.procs}
                raise SystemExit(f"{url} not healthy (exit codes: {exits})")

    def stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.send(None)
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.channels.remove()

    def pids(self, which: str) -> dict[str, int]:
        if which == "bare":
            return {"bare": self.bare.pid, "client": self.client.pid}
        return {"api": self.api.pid, "tokenizer": self.tokenizer.pid,
                "standin": self.standin.pid, "client": self.client.pid}  # fmt: skip

    def load(self, which: str, c: int, warmup: int, target: int, max_seconds: float) -> dict:
        """The client's command: `c` streams to `which` ("ours" or "bare") in a closed
        loop, timed over `target` tokens after `warmup` (at most `max_seconds`)."""
        url = self.ours_url if which == "ours" else self.bare_url
        return {"url": url, "concurrency": c, "max_tokens": self.args.max_tokens,
                "warmup": warmup, "target": target, "pids": self.pids(which),
                "max_seconds": max_seconds}  # fmt: skip

    def measure(self, which: str, c: int, step_s: float = 0.0, target: int | None = None,
                warmup: int | None = None, max_seconds: float = 600.0) -> dict:  # fmt: skip
        """One point; on a shared machine, measured again (up to `--retries` times) when
        other processes took more than twice `--quiet-limit` of CPU meanwhile."""
        a = self.args
        target = a.tokens if target is None else target
        warmup = a.warmup if warmup is None else warmup
        for attempt in range(a.retries + 1):
            quiet_first(a)
            self.step_s.value = step_s
            try:
                self.conn.send(self.load(which, c, warmup, target, max_seconds))
                status, res = self.conn.recv()
            finally:
                self.step_s.value = 0.0
            if status != "ok":
                raise SystemExit(f"the client failed on {which}, {c} streams: {res}")
            if which == "ours":
                wait_lifecycle_zero(self.ours_url)
            noisy = a.quiet_limit > 0 and res["others_cpu_pct"] > 2 * a.quiet_limit
            if not noisy or attempt == a.retries:
                break
            say(f"  (other processes took {res['others_cpu_pct']:.0f}% CPU meanwhile: again)")
        return {**res, "step_ms": 1000 * step_s, "attempts": attempt + 1}

    def capacity(self, c: int) -> dict:
        """The highest paced rate (chunks/s offered = c / step) at which ours still keeps
        one token per chunk and delivers what is emitted: doubling from CAPACITY_START, then
        bisection to within 10 %. The doubling stops early when offering more made the
        stand-in emit no more (its core is full: ours kept up with all there was). The rate
        found is measured last over --paced-tokens; a rate that passed a short trial may
        still fall behind over that long run: then 20 % lower, at most three times."""
        lo, hi, rate, prev_emitted, trials = None, None, CAPACITY_START, 0.0, []
        source_limited = False
        for _ in range(CAPACITY_TRIALS):
            res = self.measure("ours", c, c / rate, target=max(int(rate * 1.5), 2000),
                               warmup=max(int(rate * 0.3), 500), max_seconds=30)  # fmt: skip
            kept = (res["tokens_per_chunk"] or 99) <= KEPT_UP_TOKENS_PER_CHUNK and (
                res["tokens_per_s"] >= 0.95 * res["emitted_per_s"]
            )
            trials.append({"offered_per_s": rate, "kept_up": kept, **brief(res)})
            say(
                f"    capacity c={c}: offered {rate:7.0f}/s -> {res['tokens_per_s']:7.0f} tok/s "
                f"{res['tokens_per_chunk'] or 0:5.2f} tok/chunk  {'ok' if kept else 'behind'}"
            )
            source_limited = kept and hi is None and res["emitted_per_s"] < 1.1 * prev_emitted
            if kept:
                lo, prev_emitted = rate, max(prev_emitted, res["emitted_per_s"])
            else:
                hi = rate
            if (lo and hi and hi / lo < 1.1) or source_limited:
                break
            rate = rate * 2 if hi is None else (lo + hi) / 2 if lo else rate / 2
        if source_limited:
            say(f"    capacity c={c}: the stand-in's core is the limit")
        if lo is None:
            return {"trials": trials, "final": None}
        for _ in range(3):
            final = self.measure("ours", c, c / lo, target=self.args.paced_tokens)
            if (final["tokens_per_chunk"] or 99) <= KEPT_UP_TOKENS_PER_CHUNK:
                break
            say(
                f"    capacity c={c}: {final['tokens_per_chunk']:.2f} tok/chunk over the long "
                f"run at {lo:.0f}/s: again at {0.8 * lo:.0f}/s"
            )
            lo *= 0.8
        return {"trials": trials, "offered_per_s": lo, "source_limited": source_limited,
                "final": final}  # fmt: skip


def say_point(which: str, c: int, res: dict) -> None:
    cpu = " ".join(f"{k}={v:.0f}" for k, v in res["cpu_pct"].items())
    say(
        f"  c={c:<3} {which:<13} {res['chunks_per_s']:8.0f} chunks/s "
        f"{res['tokens_per_s']:8.0f} tokens/s  cpu% {cpu} others={res['others_cpu_pct']:.0f}"
    )


def run(args) -> dict:
    """Every point of `args.concurrency`, then the profile: the JSON record."""
    bench = Bench(args)
    try:
        bench.start()
        identical = check_identical(bench.ours_url, bench.bare_url, bench.step_s)
        say(
            f"uvicorn loop={bench.loop} http={bench.http}; {bench.ncpu} CPUs; servers on "
            f"{bench.server_cpus or 'any'}, client + tokenizer + stand-in on "
            f"{bench.other_cpus or 'any'}; byte check {identical}"
        )
        points = []
        for c in args.concurrency:
            point: dict = {"concurrency": c}
            for which, key in (("bare", "bare"), ("ours", "ours_burst")):
                point[key] = bench.measure(which, c)
                say_point(key, c, point[key])
            if args.capacity:
                point["ours_paced"] = bench.capacity(c)
                if point["ours_paced"]["final"]:
                    say_point("ours_paced", c, point["ours_paced"]["final"])
            points.append(point)
        profile = run_profile(args, bench) if args.profile != "none" else None
    finally:
        bench.stop()
    return {
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpus": bench.ncpu,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },  # fmt: skip
        "uvicorn": {"loop": bench.loop, "http": bench.http},
        "layout": {
            "server_cpus": sorted(bench.server_cpus or []),
            "other_cpus": sorted(bench.other_cpus or []),
        },  # fmt: skip
        "settings": {k: getattr(args, k) for k in ("max_tokens", "tokens", "warmup")},
        "byte_check": identical,
        "points": points,
        "table": table_rows(points),
        "profile": profile,
    }


# ============================================================================ the table
def us_per_chunk(res: dict, proc: str) -> float | None:
    """CPU microseconds `proc` spent per delivered chunk (cpu % is per second)."""
    return 1e4 * res["cpu_pct"][proc] / res["chunks_per_s"] if res["chunks_per_s"] else None


def table_rows(points: list[dict]) -> list[dict]:
    rows = []
    for pt in points:
        bare, burst = pt["bare"], pt["ours_burst"]
        paced = (pt.get("ours_paced") or {}).get("final")
        row = {
            "concurrency": pt["concurrency"],
            "bare_chunks_per_s": bare["chunks_per_s"],
            "bare_us_per_chunk": us_per_chunk(bare, "bare"),
            "ours_paced_chunks_per_s": None,
            "ours_burst_chunks_per_s": burst["chunks_per_s"],
            "ours_burst_tokens_per_s": burst["tokens_per_s"],
            "ratio_burst_tokens": burst["tokens_per_s"] / bare["chunks_per_s"],
            "others_cpu_pct_max": max(r["others_cpu_pct"] for r in (bare, burst, paced) if r),
        }
        if paced:
            api_us = us_per_chunk(paced, "api")
            row.update(
                ours_paced_chunks_per_s=paced["chunks_per_s"],
                ours_paced_tokens_per_chunk=paced["tokens_per_chunk"],
                ratio_paced_chunks=paced["chunks_per_s"] / bare["chunks_per_s"],
                ours_api_us_per_chunk=api_us,
                ours_tokenizer_us_per_chunk=us_per_chunk(paced, "tokenizer"),
                # what one full server core would sustain, from the CPU each spent per chunk
                ratio_per_core=row["bare_us_per_chunk"] / api_us,
            )
        rows.append(row)
    return rows


def print_table(record: dict) -> None:
    print("\nchunks/s delivered to the client; CPU us per chunk of the server process")
    print(" streams | bare chunks/s  us/chunk | ours paced chunks/s (tok/chunk)  ratio  api "
          "us/chunk  tok us/chunk  ratio/core | ours burst chunks/s  tokens/s  ratio tokens "
          "| others CPU%")  # fmt: skip
    for r in record["table"]:
        paced = f"{'-':>78}"
        if r["ours_paced_chunks_per_s"]:
            paced = (
                f"{r['ours_paced_chunks_per_s']:19.0f} ({r['ours_paced_tokens_per_chunk']:.2f})"
                f"  {r['ratio_paced_chunks']:5.2f}  {r['ours_api_us_per_chunk']:12.1f}"
                f"  {r['ours_tokenizer_us_per_chunk']:12.1f}  {r['ratio_per_core']:10.2f}"
            )
        print(f" {r['concurrency']:>7} | {r['bare_chunks_per_s']:13.0f}  "
              f"{r['bare_us_per_chunk']:8.1f} | {paced} | {r['ours_burst_chunks_per_s']:19.0f} "
              f"{r['ours_burst_tokens_per_s']:9.0f}  {r['ratio_burst_tokens']:12.2f} | "
              f"{r['others_cpu_pct_max']:.0f}")  # fmt: skip


# ============================================================================ profile
def frame_name(frame: str) -> str:
    """py-spy raw frame 'func (path/to/file.py:123)' -> 'path/to/file.py:func'."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    path = m.group(2).split("site-packages/")[-1].split(str(REPO) + "/")[-1]
    return f"{path}:{m.group(1)}"


def summarize_collapsed(text: str, top: int = 30) -> dict:
    """Self shares of the samples per function, and inclusive shares of minisgl's own
    functions, from py-spy's raw (collapsed stacks) output."""
    self_c, incl_c, total = Counter(), Counter(), 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [frame_name(f) for f in stack.split(";")]
        self_c[frames[-1]] += k
        for f in {f for f in frames if f.startswith("minisgl/")}:
            incl_c[f] += k

    def share(c: Counter) -> list:
        return [(name, round(100 * v / total, 1)) for name, v in c.most_common(top)]

    return {"samples": total, "self_pct": share(self_c), "minisgl_inclusive_pct": share(incl_c)}


def run_profile(args, bench: Bench) -> dict:
    """Load our API server with `--profile-concurrency` streams (paced at
    `--profile-rate` chunks/s, 0: burst) and sample `--profile-process` with py-spy in its
    blocking mode (it pauses the process per sample: --nonblocking reads the stacks while
    they change and records frames that never called each other)."""
    c, rate, seconds = args.profile_concurrency, args.profile_rate, args.profile_seconds
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--profile py-spy: no py-spy on PATH (pip install py-spy)")
    raw = f"/tmp/minisgl-frontend-profile-{os.getpid()}.txt"
    out: dict = {"tool": "py-spy", "process": args.profile_process, "concurrency": c,
                 "rate": rate, "seconds": seconds, "raw": raw}  # fmt: skip
    bench.step_s.value = c / rate if rate else 0.0
    bench.conn.send(bench.load("ours", c, 0, 10**12, seconds + 4))
    time.sleep(2)  # let the streams start
    try:
        pid = bench.pids("ours")[args.profile_process]
        cmd = [py_spy, "record", "--pid", str(pid), "--rate", "100", "--duration",
               str(max(1, int(seconds) - 1)), "--format", "raw", "--output", raw]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        out.update(summarize_collapsed(Path(raw).read_text()))
    finally:
        status, load = bench.conn.recv()
        bench.step_s.value = 0.0
    out["load"] = brief(load) if status == "ok" else status
    wait_lifecycle_zero(bench.ours_url)
    return out


def print_profile(profile: dict) -> None:
    print(f"\nprofile of {profile['process']} (py-spy, {profile['concurrency']} streams at "
          f"{profile['rate'] or 'burst'} chunks/s offered, {profile['seconds']:.0f} s; load "
          f"meanwhile: {profile['load']})")  # fmt: skip
    for key in ("self_pct", "minisgl_inclusive_pct"):
        print(f"  -- {key.replace('_pct', '')}: % of samples, function")
        for name, pct in profile[key][:20]:
            print(f"    {pct:5.1f}  {name}")


# ============================================================================ main
def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--tokens", type=int, default=100000,
                   help="tokens measured per bare and burst point")  # fmt: skip
    p.add_argument("--paced-tokens", type=int, default=30000,
                   help="tokens measured at ours' paced capacity")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3000, help="tokens before measuring")
    p.add_argument("--capacity", action=argparse.BooleanOptionalAction, default=True,
                   help="search ours' paced capacity at one token per chunk")  # fmt: skip
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    p.add_argument("--pin", default="auto", choices=["auto", "none"])
    add_quiet_flags(p, limit=25.0, timeout=300.0)  # before each point
    p.add_argument("--retries", type=int, default=3,
                   help="measure a point again when others took over twice --quiet-limit")  # fmt: skip
    p.add_argument("--profile", default="none", choices=["none", "py-spy"])
    p.add_argument("--profile-seconds", type=float, default=20.0)
    p.add_argument("--profile-concurrency", type=int, default=64)
    p.add_argument("--profile-process", default="api", choices=["api", "tokenizer"])
    p.add_argument("--profile-rate", type=float, default=0.0,
                   help="chunks/s offered while profiling (0: burst)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM: leave through the `finally` that stops every child process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    record = run(args)
    print_table(record)
    if record["profile"]:
        print_profile(record["profile"])
    if args.json:
        write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
