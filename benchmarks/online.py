"""Online serving benchmark: a load generator against a running minisgl (or any OpenAI-style)
server, over streaming chat completions.

Workload: `--num-requests` chat requests, each one user message of random common English
words (seeded by `--seed`) sized to roughly `--input-len` tokens, with
`max_tokens=--output-len`, `ignore_eos: true` and greedy sampling, so every request
generates exactly `--output-len` tokens (unless the context is shorter). Arrivals are a
Poisson process of `--request-rate` requests per second (`inf`: all at once), with at most
`--concurrency` in flight.

What is measured, per request, on the client's clock:
- TTFT: from sending the request to the first SSE chunk that carries content;
- inter-token latency (ITL): the gaps between consecutive content chunks of one request
  (a server that coalesces several tokens into one chunk shows fewer, longer gaps);
- output tokens: the `usage` of each stream, asked for with
  `stream_options: {"include_usage": true}` (the last chunk before [DONE]). A server that
  refuses stream_options: before the run, one non-streaming request of the same shape
  reports `usage.completion_tokens`, and with `ignore_eos` every request that ends with
  finish_reason "length" generated that many (the report says which source it used).
  Content chunks are counted too (fewer chunks than tokens: the server coalesced tokens
  that were ready together into one chunk).

Run from the repository root, against a server that is already up:

    python benchmarks/online.py --base-url http://127.0.0.1:1919 --num-requests 64 \
        --concurrency 16 --input-len 256 --output-len 128

or as one command that starts a CPU server with the embedded model for the run and stops
it afterwards:

    python benchmarks/online.py --launch --num-requests 16 --concurrency 4 \
        --input-len 128 --output-len 64

An A/B of a server setting in the same run (`--launch` with `--baseline-server-arg`): two
servers are started, the same load runs against each in turn `--pairs` times (baseline
first in each pair), and the report gives the output-throughput ratio of each pair and
their median, the figure a noisy machine allows. For example, what request timelines
cost (on by default) against a server that records none:

    python benchmarks/online.py --launch --baseline-server-arg=--debug-history=0 --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
from common import add_engine_flags, group_cpu_seconds, machine_busy_seconds, wait_quiet, write_json
from tqdm.asyncio import tqdm

from minisgl.testing.sse import DONE, aiter_payloads

# Common English words that SmolLM2's (and most BPE) tokenizers keep as one token with the
# leading space, so `n` words make roughly `n` prompt tokens.
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


# ---------------------------------------------------------------------------- results
@dataclass
class RequestResult:
    ok: bool
    start: float  # perf_counter when the request was sent
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int | None = None  # from the stream's usage chunk

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (no interpolation), in milliseconds."""
    if not values:
        return {f"p{p}": None for p in ps} | {"mean": None}
    s = sorted(values)
    out = {f"p{p}": 1000 * s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] for p in ps}
    out["mean"] = 1000 * statistics.fmean(s)
    return out


# ---------------------------------------------------------------------------- workload
def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=max(1, input_len))) for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def chat_body(
    model: str, prompt: str, output_len: int, stream: bool, include_usage: bool = False
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


# ---------------------------------------------------------------------------- client
async def stream_one(client: httpx.AsyncClient, body: dict) -> RequestResult:
    res = RequestResult(ok=False, start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for data in aiter_payloads(r.aiter_lines(), strict=False):
                if data == DONE:
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"].get("message", str(event["error"]))
                    continue
                if event.get("usage"):
                    res.completion_tokens = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        res.ok = res.error is None and res.finish_reason is not None
        if not res.ok and res.error is None:
            res.error = "the stream ended without a finish_reason"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.end = time.perf_counter()
    return res


async def run_load(args, model: str, prompts: list[str]) -> tuple[list[RequestResult], float]:
    offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
    limit = args.concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(
        base_url=args.base_url, limits=limits, timeout=timeout, headers=_auth(args)
    ) as client:
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress)
        t0 = time.perf_counter()

        async def one(prompt: str, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:  # TTFT counts from the send, not from the arrival
                body = chat_body(model, prompt, args.output_len, True, args.include_usage)
                res = await stream_one(client, body)
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
        duration = time.perf_counter() - t0
        bar.close()
    return list(results), duration


def _auth(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("MINISGL_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def get_model(base_url: str, headers: dict[str, str]) -> str:
    r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def usage_check(args, model: str, prompt: str) -> dict:
    """One non-streaming request of the same shape: its usage gives the real prompt and
    output token counts (and warms the server up)."""
    body = chat_body(model, prompt, args.output_len, stream=False)
    r = httpx.post(
        f"{args.base_url}/v1/chat/completions", json=body, headers=_auth(args), timeout=args.timeout
    )
    r.raise_for_status()
    out = r.json()
    check = {**out["usage"], "finish_reason": out["choices"][0]["finish_reason"]}
    # does the server take stream_options (per-stream usage)? one token's worth to find out
    body = chat_body(model, "hi", 1, stream=True, include_usage=True)
    r = httpx.post(
        f"{args.base_url}/v1/chat/completions", json=body, headers=_auth(args), timeout=60
    )
    check["stream_usage"] = r.status_code == 200 and b'"usage"' in r.content
    return check


def summarize(args, model: str, results, duration: float, check: dict) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tokens_per_req = check["completion_tokens"]
    ok_length = [r for r in ok if r.finish_reason == "length"]
    if ok and all(r.completion_tokens is not None for r in ok):
        source, output_tokens = "stream usage", sum(r.completion_tokens for r in ok)
    else:
        source, output_tokens = "non-stream check x requests", tokens_per_req * len(ok_length)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "model": model,
        "base_url": args.base_url,
        "config": {
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
        },
        "prompt_tokens_per_request": check["prompt_tokens"],
        "output_tokens_per_request": tokens_per_req,
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens": output_tokens,
        "output_tokens_source": source,
        "output_tokens_per_s": output_tokens / duration,
        "content_chunks": chunks,
        "content_chunks_per_s": chunks / duration,
        "chunks_per_request": chunks / len(ok) if ok else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([g for r in ok for g in r.itls]),
        "e2e_latency_ms": percentiles([r.end - r.start for r in ok]),
    }


def print_report(s: dict) -> None:
    def row(name, value):
        print(f"  {name:<34}{value}")

    def lat(name, d):
        if d["p50"] is None:
            row(name, "-")
        else:
            row(
                name,
                f"p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}  mean {d['mean']:.1f}",
            )

    c = s["config"]
    print(f"\n== online benchmark: {s['model']} at {s['base_url']}")
    row(
        "requests (concurrency, rate)",
        f"{c['num_requests']} ({c['concurrency'] or 'unlimited'}, {c['request_rate']}/s)",
    )
    row(
        "tokens per request in / out",
        f"{s['prompt_tokens_per_request']} / "
        f"{s['output_tokens_per_request']}  (asked ~{c['input_len']} / {c['output_len']})",
    )
    row("requests ok / failed", f"{s['requests_ok']} / {s['requests_failed']}")
    for err in s["errors"]:
        row("  error", err)
    row("duration", f"{s['duration_s']:.2f} s")
    row("request throughput", f"{s['request_throughput']:.2f} req/s")
    row(
        "output token throughput",
        f"{s['output_tokens_per_s']:.1f} tok/s  ({s['output_tokens']} tokens, from "
        f"{s['output_tokens_source']})",
    )
    row("content chunks per request", f"{s['chunks_per_request'] or 0:.1f}")
    lat("TTFT (ms)", s["ttft_ms"])
    lat("inter-chunk latency ITL (ms)", s["itl_ms"])
    lat("end-to-end latency (ms)", s["e2e_latency_ms"])
    if "cpu" in s:
        u = s["cpu"]
        row(
            "CPU cores used (avg)",
            f"machine {u['machine_cores']:.2f}, server "
            f"{u['server_cores']:.2f}, client {u['client_cores']:.2f}, "
            f"others {u['others_cores']:.2f}",
        )


# ---------------------------------------------------------------------------- CPU use
def cpu_snapshot(pgid: int | None) -> tuple[float, float, float]:
    t = os.times()
    return machine_busy_seconds(), group_cpu_seconds(pgid), t.user + t.system


def cpu_use(a, b, seconds: float) -> dict[str, float]:
    """Cores used on average between two snapshots: the machine, the launched server,
    this client, and everything else (other work on a shared machine skews the figures)."""
    machine, server, client = ((y - x) / seconds for x, y in zip(a, b))
    return {
        "machine_cores": machine,
        "server_cores": server,
        "client_cores": client,
        "others_cores": machine - client - (server if server == server else 0.0),
    }


# ---------------------------------------------------------------------------- --launch
@contextmanager
def launched_server(args):
    """`python -m minisgl --device DEVICE` on a free port for the run (the tests' harness);
    stopped after with SIGINT (minisgl: abort what is left, stop the workers)."""
    # imported here: against a server that is already up, only httpx and tqdm are needed
    from minisgl.testing.server import RunningServer

    extra = ["--log-level", "warning", *args.server_arg]
    server = RunningServer(args.model, *extra, device=args.device, wait=False)
    log = server.log_path
    print(f"launching: {' '.join(server.cmd)}  (log, kept on failure: {log})", file=sys.stderr)
    args.server_pgid = server.proc.pid  # its own session: the group holds server and workers
    ok = False
    try:
        try:
            server.wait_healthy(args.launch_timeout)
        except RuntimeError as exc:
            raise SystemExit(f"the launched {exc}") from None
        yield server.base_url
        ok = True
    finally:
        server.stop(signal.SIGINT)
        if ok:  # the log is kept only when something went wrong
            server.log_path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument(
        "--model",
        default=None,
        help="model name to request (default: the first of GET /v1/models); "
        "with --launch, the model to serve (default: the embedded one)",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument(
        "--concurrency", type=int, default=8, help="most requests in flight (0: no limit)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; inf sends all at once",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, EOS ignored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--api-key", default=None, help="default: $MINISGL_API_KEY")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--quiet-limit",
        type=float,
        default=0.0,
        help="before the load, wait until the machine's CPU use is under this %% of one "
        "core (a shared machine; 0: do not wait)",
    )
    p.add_argument("--quiet-timeout", type=float, default=600.0)
    g = p.add_argument_group("--launch: start a server for the run")
    g.add_argument(
        "--launch",
        action="store_true",
        help="start `python -m minisgl` on a free port, run, stop it",
    )
    add_engine_flags(g, "device", device="cpu")  # the launched server's
    g.add_argument("--launch-timeout", type=float, default=600.0)
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the launched server (repeatable), "
        "e.g. --server-arg=--max-running-requests=8",
    )
    g.add_argument(
        "--baseline-server-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="A/B: also launch a baseline server with these extra arguments (repeatable) "
        "and report the launched server's throughput as a ratio of the baseline's",
    )
    g.add_argument("--pairs", type=int, default=3, help="A/B: baseline-candidate pairs")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 0 or args.request_rate <= 0:
        p.error("--num-requests must be >= 1, --concurrency >= 0, --request-rate > 0")
    if args.baseline_server_arg is not None and not args.launch:
        p.error("--baseline-server-arg needs --launch")
    return args


def run(args) -> dict:
    model = (
        args.model if (args.model and not args.launch) else get_model(args.base_url, _auth(args))
    )
    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    check = usage_check(args, model, prompts[0])
    args.include_usage = check["stream_usage"]
    if check["completion_tokens"] != args.output_len:
        print(
            f"note: the server generated {check['completion_tokens']} tokens for max_tokens="
            f"{args.output_len} (finish_reason {check['finish_reason']})",
            file=sys.stderr,
        )
    pgid = getattr(args, "server_pgid", None)
    if args.quiet_limit > 0:
        busy = wait_quiet(args.quiet_limit, args.quiet_timeout)
        if busy > args.quiet_limit:
            print(f"other processes use {busy:.0f}% CPU; measuring anyway", file=sys.stderr)
    before = cpu_snapshot(pgid)
    results, duration = asyncio.run(run_load(args, model, prompts))
    summary = summarize(args, model, results, duration, check)
    summary["cpu"] = cpu_use(before, cpu_snapshot(pgid), duration)
    return summary


def compare(args) -> dict:
    """A/B: the same load against a baseline server and the candidate, pair by pair."""
    import copy

    base_args = copy.copy(args)
    base_args.server_arg = [*args.server_arg, *args.baseline_server_arg]
    pairs = []
    with launched_server(base_args) as base_url, launched_server(args) as cand_url:
        cand_pgid = args.server_pgid
        for i in range(args.pairs):
            base_args.base_url, args.base_url = base_url, cand_url
            baseline = run(base_args)
            args.server_pgid = cand_pgid
            candidate = run(args)
            ratio = candidate["output_tokens_per_s"] / baseline["output_tokens_per_s"]
            print(f"pair {i + 1}: candidate / baseline throughput {ratio:.3f}", file=sys.stderr)
            pairs.append({"baseline": baseline, "candidate": candidate, "ratio": ratio})
    ratios = [p["ratio"] for p in pairs]
    return {
        "baseline_server_args": base_args.server_arg,
        "candidate_server_args": args.server_arg,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "pairs": pairs,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline_server_arg is not None:
        result = compare(args)
        for pair in result["pairs"]:
            print_report(pair["candidate"])
        print(f"\nbaseline server args:  {' '.join(result['baseline_server_args']) or '-'}")
        print(f"candidate server args: {' '.join(result['candidate_server_args']) or '-'}")
        print(
            "output throughput, candidate / baseline, per pair: "
            + ", ".join(f"{r:.3f}" for r in result["ratios"])
        )
        print(f"median: {result['median_ratio']:.3f}")
        if args.json:
            write_json(args.json, result)
        failed = sum(
            p[k]["requests_failed"] for p in result["pairs"] for k in ("baseline", "candidate")
        )
        return 0 if failed == 0 else 1
    if args.launch:
        with launched_server(args) as base_url:
            args.base_url = base_url
            summary = run(args)
        summary["launched"] = {
            "device": args.device,
            "model": args.model or "(embedded default)",
            "server_args": args.server_arg,
        }
    else:
        summary = run(args)
    print_report(summary)
    if args.json:
        write_json(args.json, summary)
        print(f"\nwrote {args.json}")
    return 0 if summary["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
