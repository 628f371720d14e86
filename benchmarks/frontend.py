"""Frontend benchmark: how fast minisgl's API server and tokenizer worker deliver streamed
chunks, against a bare uvicorn SSE server sending byte-identical chunks, in the same run
with the same client.

Ours: the real API server (`create_app` + `FrontendManager` under uvicorn) and the real
tokenizer worker (`tokenize_worker`), each in its own process, over the real ZMQ ipc
channels of `IpcChannels`. Only the scheduler is replaced, by a stand-in process: it
answers every UserMsg with `max_tokens` DetokenizeMsgs of one token (" hello" in the
embedded model's tokenizer), the last with finish_reason "length"; each step emits one
token for every running request in one ZMQ frame, like the real scheduler; it answers
StateQueryMsg, so /debug/lifecycle works and is checked back at zero after every point.

Bare: a plain ASGI app under uvicorn with the same settings (one worker, the same loop and
HTTP implementation) that sends, per request, the SSE bytes our server sends for
`max_tokens` tokens delivered one per chunk: the same JSON shape and size, the same chunk
count, the same number of ASGI sends. The script checks the bytes before measuring.

Client: its own process, httpx async streaming, C streams in a closed loop (a stream that
ends starts the next request). It counts, over the raw bytes, SSE content chunks and the
tokens in them. A point runs `--warmup` tokens, then times `--tokens` more.

Two measurements of ours per stream count:
- burst: the stand-in emits steps as fast as it can. The tokenizer worker and the API
  server then fall behind it, and the FrontendManager coalesces all pending output of a
  request into one chunk (by design), so ours sends far fewer, bigger chunks; the table
  gives its chunks/s and tokens/s apart (for bare they are the same number).
- paced capacity: the stand-in steps at a set rate; the highest rate at which ours still
  delivers every emitted token at one token per chunk (tokens/chunk <= 1.1 and >= 95 % of
  the emitted tokens delivered) is searched. That rate in chunks/s against bare's
  chunks/s is the like-for-like ratio.

CPU layout (`--pin auto`, 2 or more cores): the server under test (ours: the API server
process; bare: its one process) alone on core 0; the client, the tokenizer worker and the
stand-in on the other cores. Each point records every process's CPU and the CPU used by
processes outside the benchmark (on a shared machine they skew the figures).

    python benchmarks/frontend.py                                  # 1, 16 and 64 streams
    python benchmarks/frontend.py --concurrency 64 --no-capacity --profile py-spy

`--profile py-spy` (`pip install py-spy`; `--py-spy PATH` if not on PATH) samples our API
server under `--profile-concurrency` paced streams after the measurements; `--profile
cprofile` runs cProfile inside the API server process instead. Both print the hottest
functions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from frontend_stack import (  # noqa: E402
    MODEL_NAME,
    WORD,
    client_main,
    machine_busy_seconds,
    run_tokenizer,
    serve_bare,
    serve_ours,
    standin_scheduler,
)
from profile_summary import print_profile, summarize_collapsed, summarize_pstats  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uvicorn_impls(loop: str, http: str) -> tuple[str, str]:
    """Resolve uvicorn's "auto" as uvicorn does, so the report names what ran."""
    import importlib.util

    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def wait_http(url: str, procs, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.is_alive():
                raise SystemExit(f"{p.name} exited with {p.exitcode} during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise SystemExit(f"{url} not healthy after {timeout} s")


def wait_lifecycle_zero(url: str, timeout: float = 15.0) -> dict:
    """After a point (whose streams were cancelled mid-way): every component at zero."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/debug/lifecycle", timeout=5).json()
        busy = (
            state["frontend"]["requests"],
            state["tokenizer"]["decode_states"],
            state["scheduler"]["running"],
        )
        if busy == (0, 0, 0):
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
    import httpx

    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
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
    return {
        "identical_body": True,
        "same_header_names": set(o.headers) == set(b.headers),
        "body_bytes": len(o.content),
        "max_tokens": max_tokens,
    }


def wait_quiet(limit_pct: float, timeout: float) -> float:
    """On a shared machine: wait until the CPU busy outside this benchmark (whose own
    processes are idle between points) stays under `limit_pct` of one core for a second.
    Returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        a, t = machine_busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        busy = 100 * (machine_busy_seconds() - a) / (time.perf_counter() - t)
        if busy <= limit_pct or time.monotonic() > deadline:
            if busy > limit_pct:
                print(f"  (other processes use {busy:.0f}% CPU; measuring anyway)", flush=True)
            return busy
        time.sleep(2.0)


# ============================================================================ the run
class Bench:
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

        self.bare_url = f"http://127.0.0.1:{free_port()}"
        self.ours_url = f"http://127.0.0.1:{free_port()}"
        self.pstats = f"{a.profile_out}.pstats" if a.profile == "cprofile" else None
        r_tok, s_tok = ctx.Pipe(duplex=False)
        r_sch, s_sch = ctx.Pipe(duplex=False)
        wargs = ServerArgs(log_level="warning")
        self.tokenizer = start(
            run_tokenizer, "tokenizer", wargs, model_dir, self.channels, s_tok, self.other_cpus
        )
        self.standin = start(
            standin_scheduler,
            "standin",
            self.channels,
            ids[0],
            self.step_s,
            self.emitted,
            s_sch,
            self.other_cpus,
        )
        for r in (r_tok, r_sch):
            status, info = r.recv()
            if status != "ready":
                raise SystemExit(info)
        port = int(self.ours_url.rsplit(":", 1)[1])
        self.api = start(
            serve_ours,
            "api-server",
            port,
            self.channels,
            self.loop,
            self.http,
            self.server_cpus,
            self.pstats,
        )
        port = int(self.bare_url.rsplit(":", 1)[1])
        self.bare = start(serve_bare, "bare-server", port, self.loop, self.http, self.server_cpus)
        self.conn, child = ctx.Pipe()
        self.client = start(client_main, "client", child, self.emitted, self.other_cpus)
        wait_http(self.ours_url, self.procs)
        wait_http(self.bare_url, self.procs)

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
        return {
            "api": self.api.pid,
            "tokenizer": self.tokenizer.pid,
            "standin": self.standin.pid,
            "client": self.client.pid,
        }

    def measure(
        self,
        which: str,
        c: int,
        step_s: float = 0.0,
        target: int | None = None,
        warmup: int | None = None,
        max_seconds: float = 600.0,
    ) -> dict:
        """One point; on a shared machine, measured again (up to `--retries` times) when
        other processes took more than twice `--quiet-limit` of CPU meanwhile."""
        a = self.args
        for attempt in range(a.retries + 1):
            if a.quiet_limit > 0:
                wait_quiet(a.quiet_limit, a.quiet_timeout)
            res = self._measure_once(which, c, step_s, target, warmup, max_seconds)
            noisy = a.quiet_limit > 0 and res["others_cpu_pct"] > 2 * a.quiet_limit
            if not noisy or attempt == a.retries:
                break
            print(
                f"  (other processes took {res['others_cpu_pct']:.0f}% CPU meanwhile: again)",
                flush=True,
            )
        res["attempts"] = attempt + 1
        return res

    def _measure_once(self, which, c, step_s, target, warmup, max_seconds) -> dict:
        a = self.args
        self.step_s.value = step_s
        try:
            self.conn.send(
                {
                    "url": self.ours_url if which == "ours" else self.bare_url,
                    "concurrency": c,
                    "max_tokens": a.max_tokens,
                    "warmup": a.warmup if warmup is None else warmup,
                    "target": a.tokens if target is None else target,
                    "pids": self.pids(which),
                    "max_seconds": max_seconds,
                }
            )
            status, res = self.conn.recv()
        finally:
            self.step_s.value = 0.0
        if status != "ok":
            raise SystemExit(f"the client failed on {which}, {c} streams: {res}")
        if which == "ours":
            wait_lifecycle_zero(self.ours_url)
        res["step_ms"] = 1000 * step_s
        return res

    def capacity(self, c: int) -> dict:
        """The highest paced rate (chunks/s offered = c / step) at which ours still keeps
        one token per chunk and delivers what is emitted: doubling, then bisection."""
        a = self.args
        lo, hi, rate, trials = None, None, a.capacity_start, []
        source_limited, prev_emitted = False, 0.0
        for _ in range(a.capacity_trials):
            step = c / rate
            res = self.measure(
                "ours",
                c,
                step,
                target=max(int(rate * 1.5), 2000),
                warmup=max(int(rate * 0.3), 500),
                max_seconds=30,
            )
            kept = (res["tokens_per_chunk"] or 99) <= 1.1 and (
                res["tokens_per_s"] >= 0.95 * res["emitted_per_s"]
            )
            trials.append({"offered_per_s": rate, "kept_up": kept, **_brief(res)})
            print(
                f"    capacity c={c}: offered {rate:7.0f}/s -> {res['tokens_per_s']:7.0f} tok/s "
                f"{res['tokens_per_chunk'] or 0:5.2f} tok/chunk  {'ok' if kept else 'behind'}",
                flush=True,
            )
            # offering more made the stand-in emit no more than before: its core is full
            stalled = kept and hi is None and res["emitted_per_s"] < 1.1 * prev_emitted
            if kept:
                lo, prev_emitted = rate, max(prev_emitted, res["emitted_per_s"])
            else:
                hi = rate
            if lo and hi and hi / lo < 1.1:
                break
            if stalled:
                # ours kept up with all there was; a higher setting would only measure that
                print(f"    capacity c={c}: the stand-in's core is the limit", flush=True)
                source_limited = True
                break
            rate = rate * 2 if hi is None else (lo + hi) / 2 if lo else rate / 2
        if lo is None:
            return {"trials": trials, "final": None}
        # the long final measurement; a rate that passed a short trial may still fall
        # behind over it (tokens/chunk > 1.1): then 20 % lower, at most three times
        for _ in range(3):
            final = self.measure("ours", c, c / lo, target=self.args.paced_tokens)
            if (final["tokens_per_chunk"] or 99) <= 1.1:
                break
            print(
                f"    capacity c={c}: {final['tokens_per_chunk']:.2f} tok/chunk over the long "
                f"run at {lo:.0f}/s: again at {0.8 * lo:.0f}/s",
                flush=True,
            )
            lo *= 0.8
        return {
            "trials": trials,
            "offered_per_s": lo,
            "source_limited": source_limited,
            "final": final,
        }


def _brief(res: dict) -> dict:
    keys = (
        "tokens_per_s",
        "chunks_per_s",
        "tokens_per_chunk",
        "emitted_per_s",
        "cpu_pct",
        "others_cpu_pct",
    )
    return {k: res[k] for k in keys}


def _line(which: str, c: int, res: dict) -> str:
    cpu = " ".join(f"{k}={v:.0f}" for k, v in res["cpu_pct"].items())
    return (
        f"  c={c:<3} {which:<13} {res['chunks_per_s']:8.0f} chunks/s {res['tokens_per_s']:8.0f}"
        f" tokens/s  cpu% {cpu} others={res['others_cpu_pct']:.0f}"
    )


def run(args) -> dict:
    bench = Bench(args)
    try:
        bench.start()
        identical = check_identical(bench.ours_url, bench.bare_url, bench.step_s)
        print(
            f"uvicorn loop={bench.loop} http={bench.http}; {bench.ncpu} CPUs; servers on "
            f"{bench.server_cpus or 'any'}, client + tokenizer + stand-in on "
            f"{bench.other_cpus or 'any'}; byte check {identical}",
            flush=True,
        )
        points = []
        for c in args.concurrency:
            point: dict = {"concurrency": c, "bare": [], "ours_burst": []}
            for _ in range(args.repeats):
                for which, key in (("bare", "bare"), ("ours", "ours_burst")):
                    res = bench.measure(which, c)
                    point[key].append(res)
                    print(_line(key, c, res), flush=True)
            if args.capacity:
                point["ours_paced"] = bench.capacity(c)
                if point["ours_paced"]["final"]:
                    print(_line("ours_paced", c, point["ours_paced"]["final"]), flush=True)
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
        },
        "uvicorn": {"loop": bench.loop, "http": bench.http},
        "layout": {
            "server_cpus": sorted(bench.server_cpus or []),
            "other_cpus": sorted(bench.other_cpus or []),
        },
        "settings": {k: getattr(args, k) for k in ("max_tokens", "tokens", "warmup", "repeats")},
        "byte_check": identical,
        "points": points,
        "table": table_rows(points),
        "profile": profile,
    }


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _us_per_chunk(res: dict, proc: str) -> float | None:
    """CPU microseconds `proc` spent per delivered chunk (cpu % is per second)."""
    return 1e4 * res["cpu_pct"][proc] / res["chunks_per_s"] if res["chunks_per_s"] else None


def table_rows(points: list[dict]) -> list[dict]:
    rows = []
    for pt in points:
        bare_res = sorted(pt["bare"], key=lambda r: r["chunks_per_s"])[len(pt["bare"]) // 2]
        burst = sorted(pt["ours_burst"], key=lambda r: r["tokens_per_s"])[
            len(pt["ours_burst"]) // 2
        ]
        paced = (pt.get("ours_paced") or {}).get("final")
        bare = bare_res["chunks_per_s"]
        row = {
            "concurrency": pt["concurrency"],
            "bare_chunks_per_s": bare,
            "bare_us_per_chunk": _us_per_chunk(bare_res, "bare"),
            "ours_paced_chunks_per_s": None,
            "ours_burst_chunks_per_s": burst["chunks_per_s"],
            "ours_burst_tokens_per_s": burst["tokens_per_s"],
            "ratio_burst_chunks": burst["chunks_per_s"] / bare,
            "ratio_burst_tokens": burst["tokens_per_s"] / bare,
            "others_cpu_pct_max": max(r["others_cpu_pct"] for r in pt["bare"] + pt["ours_burst"]),
        }
        if paced:
            api_us = _us_per_chunk(paced, "api")
            row.update(
                ours_paced_chunks_per_s=paced["chunks_per_s"],
                ours_paced_tokens_per_chunk=paced["tokens_per_chunk"],
                ratio_paced_chunks=paced["chunks_per_s"] / bare,
                ours_api_us_per_chunk=api_us,
                ours_tokenizer_us_per_chunk=_us_per_chunk(paced, "tokenizer"),
                # what one full server core would sustain, from the CPU each spent per chunk
                ratio_per_core=row["bare_us_per_chunk"] / api_us,
                others_cpu_pct_max=max(row["others_cpu_pct_max"], paced["others_cpu_pct"]),
            )
        rows.append(row)
    return rows


def print_table(record: dict) -> None:
    print("\nchunks/s delivered to the client; CPU us per chunk of the server process")
    print(
        " streams | bare chunks/s  us/chunk | ours paced chunks/s (tok/chunk)  ratio  api us/chunk"
        "  tok us/chunk  ratio/core | ours burst chunks/s  tokens/s  ratio tokens | others CPU%"
    )
    for r in record["table"]:
        if r["ours_paced_chunks_per_s"]:
            paced = (
                f"{r['ours_paced_chunks_per_s']:19.0f} ({r['ours_paced_tokens_per_chunk']:.2f})"
                f"  {r['ratio_paced_chunks']:5.2f}  {r['ours_api_us_per_chunk']:12.1f}"
                f"  {r['ours_tokenizer_us_per_chunk']:12.1f}  {r['ratio_per_core']:10.2f}"
            )
        else:
            paced = f"{'-':>78}"
        print(
            f" {r['concurrency']:>7} | {r['bare_chunks_per_s']:13.0f}  {r['bare_us_per_chunk']:8.1f}"
            f" | {paced} | {r['ours_burst_chunks_per_s']:19.0f} "
            f"{r['ours_burst_tokens_per_s']:9.0f}  {r['ratio_burst_tokens']:12.2f} | "
            f"{r['others_cpu_pct_max']:.0f}"
        )


# ============================================================================ profile
def run_profile(args, bench: Bench) -> dict:
    """Load our API server with `--profile-concurrency` streams (paced at
    `--profile-rate` chunks/s, 0: burst) and sample it meanwhile."""
    c, rate = args.profile_concurrency, args.profile_rate
    out: dict = {
        "tool": args.profile,
        "process": args.profile_process,
        "concurrency": c,
        "rate": rate,
        "seconds": args.profile_seconds,
    }
    bench.step_s.value = c / rate if rate else 0.0
    bench.conn.send(
        {
            "url": bench.ours_url,
            "concurrency": c,
            "max_tokens": args.max_tokens,
            "warmup": 0,
            "target": 10**12,
            "pids": bench.pids("ours"),
            "max_seconds": args.profile_seconds + 4,
        }
    )
    time.sleep(2)  # let the streams start
    try:
        if args.profile == "py-spy":
            raw = f"{args.profile_out}.txt"
            # blocking mode (py-spy pauses the process per sample): --nonblocking reads
            # the stacks while they change and records frames that never called each other
            cmd = [
                args.py_spy,
                "record",
                "--pid",
                str(bench.pids("ours")[args.profile_process]),
                "--rate",
                "100",
                "--duration",
                str(max(1, int(args.profile_seconds) - 1)),
                "--format",
                "raw",
                "--output",
                raw,
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            out.update(raw=raw, **summarize_collapsed(Path(raw).read_text()))
        else:
            os.kill(bench.api.pid, signal.SIGUSR1)
            time.sleep(args.profile_seconds - 1)
            os.kill(bench.api.pid, signal.SIGUSR2)
            time.sleep(1)
            out.update(summarize_pstats(bench.pstats))
    finally:
        status, load = bench.conn.recv()
        bench.step_s.value = 0.0
    out["load"] = _brief(load) if status == "ok" else status
    wait_lifecycle_zero(bench.ours_url)
    return out


# ============================================================================ main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    p.add_argument(
        "--tokens", type=int, default=100000, help="tokens measured per bare and burst point"
    )
    p.add_argument(
        "--paced-tokens", type=int, default=30000, help="tokens measured at ours' paced capacity"
    )
    p.add_argument("--warmup", type=int, default=3000, help="tokens before measuring")
    p.add_argument("--repeats", type=int, default=1, help="bare/ours burst pairs per point")
    p.add_argument(
        "--capacity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="search ours' paced capacity at one token per chunk",
    )
    p.add_argument("--capacity-start", type=float, default=1000.0, help="chunks/s, first try")
    p.add_argument("--capacity-trials", type=int, default=9)
    p.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    p.add_argument("--pin", default="auto", choices=["auto", "none"])
    p.add_argument(
        "--quiet-limit",
        type=float,
        default=25.0,
        help="before each point, wait until processes outside the benchmark use "
        "less than this %% of one core (0: do not wait)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=3,
        help="measure a point again when others took over twice --quiet-limit meanwhile",
    )
    p.add_argument(
        "--quiet-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for a quiet machine before measuring anyway",
    )
    p.add_argument("--profile", default="none", choices=["none", "py-spy", "cprofile"])
    p.add_argument("--profile-seconds", type=float, default=20.0)
    p.add_argument("--profile-concurrency", type=int, default=64)
    p.add_argument(
        "--profile-process",
        default="api",
        choices=["api", "tokenizer"],
        help="which of our processes py-spy samples (cprofile: always the API server)",
    )
    p.add_argument(
        "--profile-rate",
        type=float,
        default=0.0,
        help="chunks/s offered while profiling (0: burst)",
    )
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy", help="py-spy binary")
    p.add_argument(
        "--profile-out", default="/tmp/minisgl-frontend-profile", help="prefix of the profile files"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
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
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
