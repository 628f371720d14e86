"""Isolation: what one heavy request costs the other clients of a running server.

While one client's heavy request is in flight, another client sends short streamed chat
requests one after another; the figure is their time to first token during that, against
the same requests on the idle server measured in the same run (ratio, median and worst),
and the worst gap between tokens of a stream that was already running.

Scenarios (`--scenario`):
- `long-prompt`: a prompt of `--prompt-tokens` tokens (about), which on a CPU is paced into
  chunks of about --prefill-step-seconds while others decode; `--server-arg=
  --prefill-step-seconds=0` measures it unpaced, for the ratio.
- `huge-prompt`: 3.9 MB of prompt text, more than the context can hold: refused before it
  is tokenized.
- `schema`: a JSON schema that takes the grammar library seconds to compile (an enum of
  `--enum-objects` distinct objects), which compiles in a compile process of its own until
  `--grammar-compile-timeout` ends it (a 400). The other requests are measured from when
  the tokenizer worker reports the compile under way (`grammar_compiles` in
  /debug/lifecycle), so the parse of the heavy body itself is not counted.

- `tool-description`, `many-messages`, `stop-token-ids`: bulk where the size checks once
  did not look: a 3.9 MB tool description, 118,181 empty messages, 2,000,000
  `stop_token_ids` (each a body of about 4 MB).
- `tiny-chunks`: a 1 MB body sent as 1-byte HTTP chunks (6 MB on the wire).
- `abandoned`: `--abandoned` prompts of 400 KB, each given up by its client after 0.4 s,
  then one prompt of 40 KB (too long for the context: the figure is how soon it has been
  tokenized and refused), against the same prompt on the idle server.

- `held-bodies`: `--connections` connections each send all but the last bytes of a 4 MiB
  body and hold it; the figure is the API server's resident memory then, and after they
  closed, against before (and how many were answered 503 at once: the bodies' budget).

- `retry-storm`: `--storm-clients` threads of one client (API key `storm`) send short
  requests back to back, retrying a 503 after 50 ms, against `--max-concurrent-requests`
  `--slots`; a polite client (key `polite`) sends one request at a time and honours
  Retry-After. The figures: the polite client's share of tries admitted and its time to
  first token, against the same requests on the idle server.

    python benchmarks/isolation.py                       # the embedded model, on the CPU
    python benchmarks/isolation.py --samples 20 --out isolation.json
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time

import httpx
from common import launched_minisgl, script_parser, write_json

from minisgl.testing.sse import iter_payloads


class Refused(Exception):
    """The server answered the request with an error status (a 503: it is full)."""


def ttft(http: httpx.Client, url: str, model: str, timeout: float | None = None) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 2,
        "stream": True,
    }
    start = time.perf_counter()
    with http.stream("POST", url, json=body, timeout=timeout or http.timeout) as r:
        if r.status_code != 200:
            raise Refused(r.status_code)
        for payload in iter_payloads(r.iter_lines()):
            if '"content"' in payload or '"finish_reason":"' in payload:
                return time.perf_counter() - start
    raise RuntimeError(f"no output: {r.status_code}")


def stream_gaps(http: httpx.Client, url: str, model: str, gaps: list, stop: threading.Event):
    """A long stream running throughout; the gaps between its chunks, appended as they come."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("POST", url, json=body) as r:
        last = time.perf_counter()
        for _ in r.iter_lines():
            now = time.perf_counter()
            gaps.append((now, now - last))
            last = now
            if stop.is_set():
                return


def _heavy_body(args, model: str) -> dict:
    if args.scenario == "long-prompt":
        # "wordN " is about three tokens of the embedded model; `heavy.prompt_tokens` says
        words = " ".join(f"word{i % 97}" for i in range(args.prompt_tokens // 3))
        return {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 1}
    if args.scenario == "huge-prompt":
        text = "x" * 3_900_000
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    schema = {"enum": [{"k": f"v{i:06d}", "n": i} for i in range(args.enum_objects)]}
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": schema},
        },
    }


def _bulk_body(args, model: str) -> dict:
    """The body of a scenario of bulk outside the prompt's text."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if args.scenario == "tool-description":
        tool = {"name": "f", "description": "x" * 3_900_000, "parameters": {"type": "object"}}
        return {**body, "tools": [{"type": "function", "function": tool}]}
    if args.scenario == "many-messages":
        return {**body, "messages": [{"role": "user", "content": ""}] * 118_181 + body["messages"]}
    return {**body, "stop_token_ids": [1] * 2_000_000}


def _send_in_tiny_chunks(url: str, model: str) -> int:
    """POST a 1 MB completions body as 1-byte chunks; the answer's status."""
    body = b'{"model": "%s", "prompt": "Hi", "max_tokens": 1, "user": "%s"}' % (
        model.encode(),
        b"u" * 1_000_000,
    )
    u = httpx.URL(url)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    wire = head + b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n"
    with socket.create_connection((u.host, u.port)) as s:
        try:
            s.sendall(wire)
        except OSError:  # refused before the rest was sent
            pass
        s.settimeout(300)
        answer = s.recv(64)
    return int(answer.split()[1]) if answer else 0


def _abandon(url: str, model: str, count: int) -> None:
    """`count` prompts of 400 KB sent at once, each given up after 0.4 s."""
    text = " ".join(f"word{i % 97}" for i in range(66_000))  # about 400 KB
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}

    def give_up(client: httpx.Client) -> None:
        try:
            client.post(url, json=body, timeout=0.4)
        except httpx.TimeoutException:
            pass

    with httpx.Client(limits=httpx.Limits(max_connections=count)) as client:
        threads = [threading.Thread(target=give_up, args=(client,)) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _prompt_40k(http: httpx.Client, url: str, model: str) -> float:
    """Seconds until the tokenizer worker has tokenized a 40 KB prompt: about 20,000 tokens,
    more than the embedded model's context, so the answer is the 400 that counts them."""
    text = " ".join(f"word{i % 89}" for i in range(6_600))
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    start = time.perf_counter()
    r = http.post(url, json=body)
    assert r.status_code == 400 and "tokens" in r.text, r.text
    return time.perf_counter() - start


BULK = ["tool-description", "many-messages", "stop-token-ids"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def held_bodies(args, flags: list[str]) -> dict:
    size = 4 << 20
    flags = [*flags, "--max-body-bytes", str(size), "--max-connections", "1024"]
    flags += ["--request-read-timeout", "120"]
    with launched_minisgl(args.model, *flags) as server:
        pid = server.proc.pid  # the launcher: the API server's process
        before = _rss_mb(pid)
        body = b'{"model": "m", "prompt": "Hi", "max_tokens": 1, "user": "%s"}' % (
            b"u" * (size - 100)
        )
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        conns, refused = [], 0
        for _ in range(args.connections):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(head + body[:-10])
            conns.append(s)
        time.sleep(3.0)  # the API server reads what came
        held = _rss_mb(pid)
        for s in conns:
            s.setblocking(False)
            try:
                refused += s.recv(16).startswith(b"HTTP/1.1 503")
            except BlockingIOError:
                pass
            s.close()
        time.sleep(3.0)
        after = _rss_mb(pid)
    return {
        "scenario": "held-bodies",
        "connections": args.connections,
        "body_bytes": size,
        "refused_503": refused,
        "api_server_rss_mb": {"before": before, "holding": held, "after_closing": after},
    }


def _storm(http: httpx.Client, url: str, model: str, stop: threading.Event, tally: dict):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8}
    headers = {"authorization": "Bearer storm"}
    while not stop.is_set():
        try:
            r = http.post(url, json=body, headers=headers)
        except httpx.HTTPError:  # the server going away at the end
            return
        tally[r.status_code] = tally.get(r.status_code, 0) + 1
        if r.status_code == 503:
            time.sleep(0.05)


def retry_storm(args, flags: list[str]) -> dict:
    flags = [*flags, "--max-concurrent-requests", str(args.slots), "--api-key", "storm,polite"]
    with launched_minisgl(args.model, *flags) as server:
        url = f"{server.base_url}/v1/chat/completions"
        polite = {"authorization": "Bearer polite"}
        limits = httpx.Limits(max_connections=args.storm_clients + 4)
        with httpx.Client(timeout=120, headers=polite, limits=limits) as http:
            for _ in range(3):
                ttft(http, url, server.model_name)  # warm
            idle = [ttft(http, url, server.model_name) for _ in range(args.samples)]
            stop, tally = threading.Event(), {}
            storm = [
                threading.Thread(target=_storm, args=(http, url, server.model_name, stop, tally))
                for _ in range(args.storm_clients)
            ]
            for thread in storm:
                thread.start()
            time.sleep(2.0)  # the storm holds every slot
            tries, served, timed_out = 0, [], 0
            deadline = time.perf_counter() + args.storm_seconds
            while time.perf_counter() < deadline:
                tries += 1
                try:
                    served.append(ttft(http, url, server.model_name, timeout=30.0))
                except Refused:  # a 503: wait as told
                    time.sleep(1.0)
                except httpx.TimeoutException:  # admitted, but no first token in 30 s
                    timed_out += 1
            stop.set()
            for thread in storm:
                thread.join()
    return {
        "scenario": "retry-storm",
        "slots": args.slots,
        "storm_clients": args.storm_clients,
        "storm_answers": tally,
        "polite_tries": tries,
        "polite_served": len(served),
        "polite_timed_out_30s": timed_out,
        "polite_success_rate": len(served) / tries if tries else None,
        "ttft_idle_median_s": statistics.median(idle),
        "ttft_during_median_s": statistics.median(served) if served else None,
        "ttft_during_max_s": max(served) if served else None,
    }


def main() -> int:
    p = script_parser(__doc__, "--json", "--out")
    p.add_argument("--model", default=None, help="hub id or folder (default: the embedded model)")
    scenarios = ["long-prompt", "huge-prompt", "schema", "retry-storm", *BULK]
    scenarios += ["tiny-chunks", "abandoned", "held-bodies"]
    p.add_argument("--scenario", choices=scenarios, default="schema")
    p.add_argument("--slots", type=int, default=16, help="retry-storm: --max-concurrent-requests")
    p.add_argument("--storm-clients", type=int, default=48, help="retry-storm: storm threads")
    p.add_argument("--storm-seconds", type=float, default=20.0, help="retry-storm: how long")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--abandoned", type=int, default=100, help="abandoned: how many prompts")
    p.add_argument("--connections", type=int, default=100, help="held-bodies: how many")
    p.add_argument("--server-arg", action="append", default=[], help="one more flag for the server")
    p.add_argument("--samples", type=int, default=10, help="short requests per phase")
    p.add_argument("--enum-objects", type=int, default=40_000)
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0)
    args = p.parse_args()

    flags = ["--grammar-compile-timeout", str(args.grammar_compile_timeout)]
    flags += ["--grammar-max-bytes", str(4 << 20), "--max-body-bytes", str(8 << 20)]
    flags += [a for arg in args.server_arg for a in arg.split("=", 1)]
    if args.scenario in ("retry-storm", "held-bodies"):
        record = (retry_storm if args.scenario == "retry-storm" else held_bodies)(args, flags)
        print(json.dumps(record, indent=2))
        if args.json:
            write_json(args.json, record)
        return 0
    with launched_minisgl(args.model, *flags) as server:
        url = f"{server.base_url}/v1/chat/completions"
        with httpx.Client(timeout=120) as http:
            for _ in range(3):
                ttft(http, url, server.model_name)  # warm
            idle = [ttft(http, url, server.model_name) for _ in range(args.samples)]

            gaps: list[tuple[float, float]] = []
            stop = threading.Event()
            story = threading.Thread(
                target=stream_gaps, args=(http, url, server.model_name, gaps, stop)
            )
            story.start()
            time.sleep(2.0)
            bulky = args.scenario in BULK
            heavy_body = (_bulk_body if bulky else _heavy_body)(args, server.model_name)
            heavy: dict = {}
            if args.scenario == "abandoned":
                heavy["idle_40k_s"] = _prompt_40k(http, url, server.model_name)

            def send_heavy() -> None:
                start = time.perf_counter()
                if args.scenario == "tiny-chunks":
                    heavy["status"] = _send_in_tiny_chunks(url, server.model_name)
                    heavy["seconds"] = time.perf_counter() - start
                    return
                if args.scenario == "abandoned":
                    _abandon(url, server.model_name, args.abandoned)
                    heavy["after_abandoned_40k_s"] = _prompt_40k(http, url, server.model_name)
                    heavy["seconds"] = time.perf_counter() - start
                    return
                answer = http.post(url, json=heavy_body)
                heavy["seconds"] = time.perf_counter() - start
                heavy["status"] = answer.status_code
                if answer.status_code != 200:
                    heavy["error"] = answer.json().get("error", {}).get("message")
                else:
                    heavy["prompt_tokens"] = answer.json()["usage"]["prompt_tokens"]

            sender = threading.Thread(target=send_heavy)
            sender.start()
            while (
                args.scenario == "schema"
                and not server.lifecycle()["tokenizer"]["grammar_compiles"]
            ):
                if not sender.is_alive():
                    raise RuntimeError(f"the heavy request ended before compiling: {heavy}")
                time.sleep(0.01)
            began = time.perf_counter()
            during = []
            while sender.is_alive() and len(during) < args.samples:  # sent while it runs
                during.append(ttft(http, url, server.model_name))
            sender.join()
            ended = time.perf_counter()
            stop.set()
            story.join()

    window = [gap for t, gap in gaps if began <= t <= ended + 0.5]
    before = [gap for t, gap in gaps if t < began]
    record = {
        "scenario": args.scenario,
        "heavy": {**heavy, "bytes": len(json.dumps(heavy_body))}
        if args.scenario not in ("tiny-chunks", "abandoned")
        else heavy,
        "ttft_idle_median_s": statistics.median(idle),
        "ttft_during_median_s": statistics.median(during) if during else None,
        "ttft_during_max_s": max(during) if during else None,
        "ttft_ratio_median": statistics.median(during) / statistics.median(idle)
        if during
        else None,
        "samples_during": len(during),
        "stream_gap_max_before_s": max(before) if before else None,
        "stream_gap_max_during_s": max(window) if window else None,
        # when the worst gap ended, in seconds after the heavy request was sent
        "stream_gap_max_at_s": max((g, t - began) for t, g in gaps if began <= t <= ended + 0.5)[1]
        if window
        else None,
    }
    print(json.dumps(record, indent=2))
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
