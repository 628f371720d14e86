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

Here are the measurements (`Bench`, `run`, `run_profile`), which print nothing themselves:
the lines printed meanwhile and the final table are frontend_report.py's, the profile
summaries profile_summary.py's, the processes frontend_stack.py's.
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
from pathlib import Path

import httpx
from common import wait_quiet, write_json
from frontend_report import Progress, print_table, table_rows
from frontend_stack import (
    WORD,
    chat_request,
    client_main,
    run_tokenizer,
    serve_bare,
    serve_ours,
    standin_scheduler,
)
from profile_summary import print_profile, summarize_collapsed, summarize_pstats

from minisgl.testing.server import free_port, is_zero


def uvicorn_impls(loop: str, http: str) -> tuple[str, str]:
    """Resolve uvicorn's "auto" as uvicorn does, so the report names what ran."""
    import importlib.util

    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return loop, http


def wait_http(url: str, procs, timeout: float = 300.0) -> None:
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
    return {
        "identical_body": True,
        "same_header_names": set(o.headers) == set(b.headers),
        "body_bytes": len(o.content),
        "max_tokens": max_tokens,
    }


# ============================================================================ the run
class Bench:
    """The processes of one run and the measurements made with them; what happens is told
    to `progress` (frontend_report.Progress: printed)."""

    def __init__(self, args, progress: Progress | None = None) -> None:
        self.args = args
        self.progress = progress or Progress()

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
        self.api = start(
            serve_ours,
            "api-server",
            ours_port,
            self.channels,
            self.loop,
            self.http,
            self.server_cpus,
            self.pstats,
        )
        self.bare = start(
            serve_bare, "bare-server", bare_port, self.loop, self.http, self.server_cpus
        )
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

    def load(self, which: str, c: int, warmup: int, target: int, max_seconds: float) -> dict:
        """The client's command: `c` streams to `which` ("ours" or "bare") in a closed
        loop, timed over `target` tokens after `warmup` (at most `max_seconds`)."""
        return {
            "url": self.ours_url if which == "ours" else self.bare_url,
            "concurrency": c,
            "max_tokens": self.args.max_tokens,
            "warmup": warmup,
            "target": target,
            "pids": self.pids(which),
            "max_seconds": max_seconds,
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
                busy = wait_quiet(a.quiet_limit, a.quiet_timeout)
                if busy > a.quiet_limit:
                    self.progress.busy_machine(busy)
            res = self._measure_once(which, c, step_s, target, warmup, max_seconds)
            noisy = a.quiet_limit > 0 and res["others_cpu_pct"] > 2 * a.quiet_limit
            if not noisy or attempt == a.retries:
                break
            self.progress.disturbed(res["others_cpu_pct"])
        res["attempts"] = attempt + 1
        return res

    def _measure_once(self, which, c, step_s, target, warmup, max_seconds) -> dict:
        a = self.args
        self.step_s.value = step_s
        try:
            warmup = a.warmup if warmup is None else warmup
            target = a.tokens if target is None else target
            self.conn.send(self.load(which, c, warmup, target, max_seconds))
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
            trials.append({"offered_per_s": rate, "kept_up": kept, **brief(res)})
            self.progress.trial(c, rate, res, kept)
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
                self.progress.source_limited(c)
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
            self.progress.fell_behind(c, final["tokens_per_chunk"], lo)
            lo *= 0.8
        return {
            "trials": trials,
            "offered_per_s": lo,
            "source_limited": source_limited,
            "final": final,
        }


def brief(res: dict) -> dict:
    """The figures of a measurement kept for a capacity trial or the profile's load."""
    keys = (
        "tokens_per_s",
        "chunks_per_s",
        "tokens_per_chunk",
        "emitted_per_s",
        "cpu_pct",
        "others_cpu_pct",
    )
    return {k: res[k] for k in keys}


def run(args, progress: Progress | None = None) -> dict:
    """Every point of `args.concurrency`, then the profile: the JSON record."""
    bench = Bench(args, progress)
    progress = bench.progress
    try:
        bench.start()
        identical = check_identical(bench.ours_url, bench.bare_url, bench.step_s)
        progress.layout(
            bench.loop, bench.http, bench.ncpu, bench.server_cpus, bench.other_cpus, identical
        )
        points = []
        for c in args.concurrency:
            point: dict = {"concurrency": c, "bare": [], "ours_burst": []}
            for _ in range(args.repeats):
                for which, key in (("bare", "bare"), ("ours", "ours_burst")):
                    res = bench.measure(which, c)
                    point[key].append(res)
                    progress.point(key, c, res)
            if args.capacity:
                point["ours_paced"] = bench.capacity(c)
                if point["ours_paced"]["final"]:
                    progress.point("ours_paced", c, point["ours_paced"]["final"])
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
    bench.conn.send(bench.load("ours", c, 0, 10**12, args.profile_seconds + 4))
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
    out["load"] = brief(load) if status == "ok" else status
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
        write_json(args.json, record)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
