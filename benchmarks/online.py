"""Online serving benchmark: a load generator against a running minisgl (or any OpenAI-style)
server, over streaming chat completions.

Workload: `--num-requests` chat requests, each one user message of random common English
words (seeded by `--seed`) sized to roughly `--input-len` tokens, with
`max_tokens=--output-len`, `ignore_eos: true` and greedy sampling, so every request
generates exactly `--output-len` tokens (unless the context is shorter). Arrivals are a
Poisson process of `--request-rate` requests per second (`inf`: all at once), with at most
`--concurrency` in flight. One request of the same shape goes first, untimed (a warm-up),
with a prompt of its own: a server with a prefix cache would otherwise answer the first
timed request from it (llama.cpp's TTFT was 13 ms for a 158-token prompt that way).

What is measured, per request, on the client's clock:
- TTFT: from sending the request to the first SSE chunk that carries content;
- inter-token latency (ITL): the gaps between consecutive content chunks of one request
  (a server that coalesces several tokens into one chunk shows fewer, longer gaps);
- output tokens: the `usage` of each stream, asked for with
  `stream_options: {"include_usage": true}` (a stream without it counts as failed).
  Content chunks are counted too (fewer chunks than tokens: the server coalesced tokens
  that were ready together into one chunk).

This is the client of the figures in benchmarks/RESULTS.md (and of vs_llamacpp.py): a
fixed workload, CPU accounting of the server and of everything else on the machine, and
an A/B of two launched servers. For a general load sweep, use guidellm (a dev dependency;
tests/e2e/test_guidellm_e2e.py runs it against our server).

Against a server that is already up, or as one command that starts a CPU server with the
embedded model for the run and stops it afterwards:

    python benchmarks/online.py --base-url http://127.0.0.1:1919 --num-requests 64 \\
        --concurrency 16 --input-len 256 --output-len 128
    python benchmarks/online.py --launch --num-requests 16 --concurrency 4

An A/B of a server setting in the same run (`--launch` with `--baseline-server-arg`): two
servers are started, the same load runs against each in turn `--pairs` times (baseline
first in each pair), and the report gives the output-throughput ratio of each pair and
their median, the figure a noisy machine allows. For example, what request timelines
cost (on by default) against a server that records none:

    python benchmarks/online.py --launch --baseline-server-arg=--debug-history=0 --pairs 3
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
from common import (
    add_engine_flags,
    add_quiet_flags,
    cores_used,
    cpu_snapshot,
    launched_minisgl,
    percentiles,
    quiet_first,
    script_parser,
    write_json,
)

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


@dataclass
class Load:
    """One run's workload and where it goes."""

    base_url: str
    num_requests: int = 32
    concurrency: int = 8  # most in flight; 0: no limit
    request_rate: float = math.inf
    input_len: int = 128
    output_len: int = 64
    seed: int = 0
    timeout: float = 600.0
    api_key: str | None = None
    model: str | None = None  # None: the first of GET /v1/models
    server_pgid: int | None = None  # a launched server's process group, for its CPU

    def headers(self) -> dict[str, str]:
        key = self.api_key or os.environ.get("MINISGL_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class RequestResult:
    ok: bool
    start: float  # perf_counter when the request was sent
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None  # from the stream's usage chunk
    completion_tokens: int | None = None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


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


def chat_body(model: str, prompt: str, output_len: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


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
                if usage := event.get("usage"):
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.completion_tokens = usage["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice["delta"].get("content"):
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - res.start
                        res.chunk_times.append(now)
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if res.error is None and res.finish_reason is None:
            res.error = "the stream ended without a finish_reason"
        elif res.error is None and res.completion_tokens is None:
            res.error = "the stream carried no usage (stream_options.include_usage)"
        res.ok = res.error is None
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.end = time.perf_counter()
    return res


async def run_load(
    load: Load, model: str, prompts: list[str], warm_prompt: str
) -> tuple[RequestResult, list, float]:
    """The warm-up request, then the timed load: (warm-up, results, seconds)."""
    offsets = arrival_offsets(len(prompts), load.request_rate, load.seed)
    limit = load.concurrency or len(prompts)
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(
        base_url=load.base_url,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        timeout=httpx.Timeout(load.timeout, connect=30.0),
        headers=load.headers(),
    ) as client:
        warm = await stream_one(client, chat_body(model, warm_prompt, load.output_len))
        t0 = time.perf_counter()

        async def one(prompt: str, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            async with sem:  # TTFT counts from the send, not from the arrival
                return await stream_one(client, chat_body(model, prompt, load.output_len))

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    return warm, list(results), time.perf_counter() - t0


def summarize(load: Load, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "model": model,
        "base_url": load.base_url,
        "config": {
            k: getattr(load, k)
            for k in (
                "num_requests",
                "concurrency",
                "request_rate",
                "input_len",
                "output_len",
                "seed",
            )
        },  # fmt: skip
        "prompt_tokens_per_request": ok[0].prompt_tokens if ok else None,
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "content_chunks": chunks,
        "chunks_per_request": chunks / len(ok) if ok else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([g for r in ok for g in r.itls]),
        "e2e_latency_ms": percentiles([r.end - r.start for r in ok]),
    }


def run(load: Load) -> dict:
    """One run: the warm-up, then the timed load, with the CPU the machine, the server's
    process group, this client and everything else used meanwhile."""
    model = load.model
    if model is None:
        r = httpx.get(f"{load.base_url}/v1/models", headers=load.headers(), timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    prompts = make_prompts(load.num_requests + 1, load.input_len, load.seed)
    warm_prompt = prompts.pop()  # the timed prompts are the first ones, as before
    before = cpu_snapshot(load.server_pgid)
    warm, results, duration = asyncio.run(run_load(load, model, prompts, warm_prompt))
    used = cores_used(before, cpu_snapshot(load.server_pgid))  # the warm-up's too: small
    if not warm.ok:
        print(f"note: the warm-up request failed: {warm.error}", file=sys.stderr)
    elif warm.completion_tokens != load.output_len:
        print(f"note: the server generated {warm.completion_tokens} tokens for max_tokens="
              f"{load.output_len} (finish_reason {warm.finish_reason})", file=sys.stderr)  # fmt: skip
    summary = summarize(load, model, results, duration)
    summary["cpu"] = {"machine_cores": used["machine"], "server_cores": used["group"],
                      "client_cores": used["own"], "others_cores": used["others"]}  # fmt: skip
    return summary


def print_report(s: dict) -> None:
    def row(name, value):
        print(f"  {name:<34}{value}")

    c = s["config"]
    print(f"\n== online benchmark: {s['model']} at {s['base_url']}")
    row(
        "requests (concurrency, rate)",
        f"{c['num_requests']} ({c['concurrency'] or 'unlimited'}, {c['request_rate']}/s)",
    )
    row("prompt tokens per request", f"{s['prompt_tokens_per_request']} (asked ~{c['input_len']})")
    row("requests ok / failed", f"{s['requests_ok']} / {s['requests_failed']}")
    for err in s["errors"]:
        row("  error", err)
    row("duration", f"{s['duration_s']:.2f} s")
    row("request throughput", f"{s['request_throughput']:.2f} req/s")
    row(
        "output token throughput",
        f"{s['output_tokens_per_s']:.1f} tok/s "
        f"({s['output_tokens']} tokens, from the streams' usage)",
    )
    row("content chunks per request", f"{s['chunks_per_request'] or 0:.1f}")
    for name, key in (
        ("TTFT (ms)", "ttft_ms"),
        ("inter-chunk latency ITL (ms)", "itl_ms"),
        ("end-to-end latency (ms)", "e2e_latency_ms"),
    ):
        d = s[key]
        row(
            name,
            "-"
            if d["p50"] is None
            else f"p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}  mean {d['mean']:.1f}",
        )
    u = s["cpu"]
    row("CPU cores used (avg)", f"machine {u['machine_cores']:.2f}, server {u['server_cores']:.2f}, "
        f"client {u['client_cores']:.2f}, others {u['others_cores']:.2f}")  # fmt: skip


# ---------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default=None,
                   help="model name to request (default: the first of GET /v1/models); "
                   "with --launch, the model to serve (default: the embedded one)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="most in flight (0: no limit)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second; inf sends all at once")  # fmt: skip
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, EOS ignored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--api-key", default=None, help="default: $MINISGL_API_KEY")
    add_quiet_flags(p)
    g = p.add_argument_group("--launch: start a server for the run")
    g.add_argument("--launch", action="store_true",
                   help="start `python -m minisgl` on a free port, run, stop it")  # fmt: skip
    add_engine_flags(g, "device", device="cpu")  # the launched server's
    g.add_argument("--launch-timeout", type=float, default=600.0)
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the launched server (repeatable), "
                   "e.g. --server-arg=--max-running-requests=8")  # fmt: skip
    g.add_argument("--baseline-server-arg", action="append", default=None, metavar="ARG",
                   help="A/B: also launch a baseline server with these extra arguments "
                   "(repeatable); report the throughput as a ratio of the baseline's")  # fmt: skip
    g.add_argument("--pairs", type=int, default=3, help="A/B: baseline-candidate pairs")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.concurrency < 0 or args.request_rate <= 0:
        p.error("--num-requests must be >= 1, --concurrency >= 0, --request-rate > 0")
    if args.baseline_server_arg is not None and not args.launch:
        p.error("--baseline-server-arg needs --launch")
    return args


def load_of(args, base_url: str, pgid: int | None = None) -> Load:
    return Load(base_url, args.num_requests, args.concurrency, args.request_rate, args.input_len,
                args.output_len, args.seed, args.timeout, args.api_key,
                None if args.launch else args.model, pgid)  # fmt: skip


def measure(args, load: Load) -> dict:
    quiet_first(args)
    return run(load)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.launch:
        summaries = [measure(args, load_of(args, args.base_url))]
    else:
        arms = [("candidate", args.server_arg)]
        if args.baseline_server_arg is not None:
            arms.insert(0, ("baseline", [*args.server_arg, *args.baseline_server_arg]))
        with ExitStack() as stack:
            loads = {}
            for name, flags in arms:
                server = stack.enter_context(launched_minisgl(
                    args.model, *flags, device=args.device, timeout=args.launch_timeout))  # fmt: skip
                print(f"launched ({name}): {' '.join(server.cmd)}", file=sys.stderr)
                loads[name] = load_of(args, server.base_url, server.proc.pid)
            pairs = args.pairs if len(arms) == 2 else 1
            rounds = [{name: measure(args, loads[name]) for name, _ in arms} for _ in range(pairs)]
        summaries = [r["candidate"] for r in rounds]
    for s in summaries:
        print_report(s)
    record: dict = summaries[0]
    if args.launch and len(arms) == 2:
        ratios = [r["candidate"]["output_tokens_per_s"] / r["baseline"]["output_tokens_per_s"]
                  for r in rounds]  # fmt: skip
        record = {"baseline_server_args": arms[0][1], "candidate_server_args": arms[1][1],
                  "ratios": ratios, "median_ratio": statistics.median(ratios),
                  "pairs": rounds}  # fmt: skip
        print(f"\nbaseline server args:  {' '.join(arms[0][1]) or '-'}")
        print(f"candidate server args: {' '.join(arms[1][1]) or '-'}")
        print("output throughput, candidate / baseline, per pair: "
              + ", ".join(f"{r:.3f}" for r in ratios))  # fmt: skip
        print(f"median: {record['median_ratio']:.3f}")
        summaries = [s for r in rounds for s in r.values()]
    if args.json:
        write_json(args.json, record)
        print(f"\nwrote {args.json}")
    return 0 if all(s["requests_failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
