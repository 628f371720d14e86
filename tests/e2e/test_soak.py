"""Soak: the real server under 64 concurrent clients for several rounds of mixed traffic.

Each round sends a shuffled mix of: complete streaming and non-streaming requests, clients
that disconnect at a random moment (streaming and not), slow readers, and bad input
(malformed JSON, wrong types, an unknown model, an over-long prompt, max_tokens 10**9).
It proves: every good request gets a complete valid answer, every bad one its proper 4xx,
no 5xx ever, /debug/lifecycle back at zero after every round, and the server's resident
memory flat across rounds after a warm-up round.

Length: `MINISGL_SOAK_ROUNDS` (default 5: one warm-up and four measured rounds) or
`MINISGL_SOAK_SECONDS` (rounds until that much time has passed, at least 3);
`MINISGL_SOAK_REQUESTS` requests per round (default 1200). The default takes about a
minute on a 2-core machine with the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from e2e_helpers import (
    CHAT_PATH,
    SSE_DONE,
    ServerSpec,
    assert_error_body,
    chat_body,
    scrape_metrics,
)
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minisgl.testing.server import RunningServer, group_rss_bytes
from minisgl.testing.sse import sse_chunks

MAX_SEQ_LEN = 512  # short: a request without max_tokens ends within 512 tokens
CLIENTS = 64
ROUNDS = int(os.environ.get("MINISGL_SOAK_ROUNDS", "5"))
SECONDS = float(os.environ.get("MINISGL_SOAK_SECONDS", "0"))
REQUESTS = int(os.environ.get("MINISGL_SOAK_REQUESTS", "1200"))
PROMPTS = ["The capital of France is", "什么是 KV Cache？", "def forward(self, x):", "🚀 ✨ hi"]
MB = 1 << 20

pytestmark = [
    pytest.mark.soak,
    pytest.mark.server(ServerSpec("long_context_dir", ("--max-seq-len", str(MAX_SEQ_LEN)))),
]


@dataclass
class Tally:
    """What one round saw; `failures` must stay empty."""

    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    prompt_tokens: dict[str, int] = field(default_factory=dict)


class Bad(AssertionError):
    pass


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise Bad(what)


# ---------------------------------------------------------------- answer checks
def _check_completion(r: httpx.Response, body: dict, tally: Tally, full: bool = False) -> None:
    _check(r.status_code == 200, f"status {r.status_code}: {r.text[:300]}")
    out = r.json()
    ChatCompletion.model_validate(out)
    _check(out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion", str(out))
    choice, usage = out["choices"][0], out["usage"]
    _check(choice["finish_reason"] in ("stop", "length"), str(choice))
    _check(isinstance(choice["message"]["content"], str), str(choice))
    n, p = usage["completion_tokens"], usage["prompt_tokens"]
    _check(usage["total_tokens"] == n + p and p > 0, str(usage))
    prompt = body["messages"][0]["content"]
    _check(tally.prompt_tokens.setdefault(prompt, p) == p, f"prompt tokens vary: {usage}")
    if full:  # no max_tokens: generate until the context is full
        _check(choice["finish_reason"] == "length" and n + p == MAX_SEQ_LEN, str(usage))
    elif body.get("ignore_eos"):
        _check(choice["finish_reason"] == "length" and n == body["max_tokens"], str(usage))
    else:
        _check(1 <= n <= body["max_tokens"], str(usage))
        # short of max_tokens only by the end-of-sequence token (which may also be the last)
        _check(n == body["max_tokens"] or choice["finish_reason"] == "stop", str(out))


def _check_stream(raw: bytes, body: dict) -> None:
    _check(raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1, f"no [DONE]: {raw[-300:]!r}")
    chunks = sse_chunks(raw)
    _check(len(chunks) >= 2, f"too few chunks: {chunks}")
    _check(all("error" not in c for c in chunks), f"error event: {chunks[-1]}")
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    _check(len({c["id"] for c in chunks}) == 1, "chunk ids differ")
    _check(chunks[0]["choices"][0]["delta"].get("role") == "assistant", str(chunks[0]))
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    _check(
        reasons[-1] in ("stop", "length") and reasons.count(None) == len(reasons) - 1, str(reasons)
    )
    if body.get("ignore_eos"):
        _check(reasons[-1] == "length", str(chunks[-1]))


def _check_error(r: httpx.Response, status: int, code: str | None, param: str | None = None):
    _check(r.status_code == status, f"want {status}, got {r.status_code}: {r.text[:300]}")
    error = assert_error_body(r.json(), code)
    if param is not None:
        _check(error["param"] == param, str(error))


# ---------------------------------------------------------------- the clients
def _good_body(rng: random.Random, model: str, stream: bool) -> dict:
    body = chat_body(
        model,
        rng.choice(PROMPTS),
        max_tokens=rng.randint(8, 64),
        stream=stream,
        temperature=rng.choice([0.0, 0.7, 1.0]),
    )
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31)
    return body


async def _read_stream(r: httpx.Response, delay: tuple[float, float] | None, rng) -> bytes:
    raw = b""
    async for part in r.aiter_raw():
        raw += part
        if delay is not None:
            await asyncio.sleep(rng.uniform(*delay))
    return raw


async def normal(http, rng, model, tally):
    body = _good_body(rng, model, stream=False)
    _check_completion(await http.post(CHAT_PATH, json=body), body, tally)


async def normal_stream(http, rng, model, tally):
    body = _good_body(rng, model, stream=True)
    async with http.stream("POST", CHAT_PATH, json=body) as r:
        _check(r.status_code == 200, f"status {r.status_code}")
        _check(r.headers["content-type"].startswith("text/event-stream"), str(r.headers))
        _check_stream(await _read_stream(r, None, rng), body)


async def slow_reader(http, rng, model, tally):
    """Reads every piece late: slower than the server, far from the stall timeout."""
    body = _good_body(rng, model, stream=True)
    async with http.stream("POST", CHAT_PATH, json=body) as r:
        _check(r.status_code == 200, f"status {r.status_code}")
        _check_stream(await _read_stream(r, (0.005, 0.04), rng), body)


async def disconnect_stream(http, rng, model, tally):
    """Leaves after a random number of pieces (maybe none: before the headers)."""
    body = chat_body(model, rng.choice(PROMPTS), max_tokens=400, ignore_eos=True, stream=True)
    if rng.random() < 0.3:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_stream_to_end(http, body), rng.uniform(0.0, 0.05))
        return
    leave_after = rng.randint(1, 10)
    async with http.stream("POST", CHAT_PATH, json=body) as r:
        _check(r.status_code == 200, f"status {r.status_code}")
        seen = 0
        async for _ in r.aiter_raw():
            seen += 1
            if seen >= leave_after:
                break  # leaving the block closes the connection mid-stream


async def _stream_to_end(http, body) -> None:
    async with http.stream("POST", CHAT_PATH, json=body) as r:
        await r.aread()


async def disconnect_full(http, rng, model, tally):
    """A non-streaming client that gives up after a random moment."""
    body = chat_body(model, rng.choice(PROMPTS), max_tokens=rng.choice([16, 400]))
    body["ignore_eos"] = True
    try:
        r = await asyncio.wait_for(http.post(CHAT_PATH, json=body), rng.uniform(0.0, 0.3))
    except asyncio.TimeoutError:
        return
    _check_completion(r, body, tally)  # it was faster than the client's patience


async def bad_json(http, rng, model, tally):
    r = await http.post(
        CHAT_PATH, content=b'{"model": "' + model.encode() + b'", "messages": [{', headers=_JSON
    )
    _check_error(r, 400, None)


_JSON = {"content-type": "application/json"}
WRONG_TYPES = [
    ("max_tokens", "12"),
    ("temperature", "hot"),
    ("stream", "yes"),
    ("messages", "hi"),
    ("top_p", [0.5]),
    ("seed", 1.5),
    ("max_tokens", -3),
]


async def wrong_type(http, rng, model, tally):
    name, value = rng.choice(WRONG_TYPES)
    body = {**chat_body(model, max_tokens=8), name: value}
    _check_error(await http.post(CHAT_PATH, json=body), 400, "invalid_value", name)


async def unknown_model(http, rng, model, tally):
    body = chat_body("no-such-model", stream=rng.random() < 0.5)
    _check_error(await http.post(CHAT_PATH, json=body), 404, "model_not_found", "model")


async def over_long_prompt(http, rng, model, tally):
    body = chat_body(model, "x" * (MAX_SEQ_LEN + rng.randint(1, 200)), stream=rng.random() < 0.5)
    _check_error(await http.post(CHAT_PATH, json=body), 400, "context_length_exceeded", "messages")


async def huge_max_tokens(http, rng, model, tally):
    """More than the context holds: a 400 naming max_tokens, before any output. Left out:
    generated up to the context, so it ends with finish_reason length."""
    body = chat_body(model, rng.choice(PROMPTS), max_tokens=10**9, stream=rng.random() < 0.5)
    _check_error(
        await http.post(CHAT_PATH, json=body), 400, "context_length_exceeded", "max_tokens"
    )
    body = chat_body(model, rng.choice(PROMPTS), ignore_eos=True)
    if rng.random() < 0.5:
        _check_completion(await http.post(CHAT_PATH, json=body), body, tally, full=True)
        return
    body["stream"] = True
    async with http.stream("POST", CHAT_PATH, json=body) as r:
        _check(r.status_code == 200, f"status {r.status_code}")
        _check_stream(await _read_stream(r, None, rng), body)


# kind -> (client, share of a round)
KINDS = {
    "normal": (normal, 22),
    "normal_stream": (normal_stream, 22),
    "slow_reader": (slow_reader, 8),
    "disconnect_stream": (disconnect_stream, 10),
    "disconnect_full": (disconnect_full, 8),
    "bad_json": (bad_json, 6),
    "wrong_type": (wrong_type, 8),
    "unknown_model": (unknown_model, 6),
    "over_long_prompt": (over_long_prompt, 6),
    "huge_max_tokens": (huge_max_tokens, 4),
}


async def _one(http, kind: str, rng: random.Random, model: str, tally: Tally) -> None:
    client = KINDS[kind][0]
    tally.kinds[kind] += 1
    try:
        await asyncio.wait_for(client(http, rng, model, tally), 120)
    except Bad as exc:
        tally.failures.append(f"{kind}: {exc}")
    except Exception as exc:  # a hang, a cut connection, an invalid body: all failures
        tally.failures.append(f"{kind}: {type(exc).__name__}: {exc}")


async def _round(server: RunningServer, seed: int) -> Tally:
    rng = random.Random(seed)
    names = list(KINDS)
    jobs = rng.choices(names, weights=[KINDS[k][1] for k in names], k=REQUESTS)
    tally = Tally()
    queue: asyncio.Queue[str] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    def log_status(response: httpx.Response) -> None:
        tally.statuses[response.status_code] += 1

    async def hook(response: httpx.Response) -> None:
        log_status(response)

    # idle connections are dropped by the client before uvicorn's 5 s keep-alive timeout
    # closes them: otherwise a request sent just as the server closes its idle connection
    # is reset (a race of HTTP/1.1 keep-alive itself, not of the server under test)
    limits = httpx.Limits(
        max_connections=CLIENTS, max_keepalive_connections=CLIENTS, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(
        base_url=server.base_url,
        timeout=httpx.Timeout(60, connect=10),
        limits=limits,
        event_hooks={"response": [hook]},
    ) as http:

        async def client(i: int) -> None:
            crng = random.Random(f"{seed}-{i}")
            while not queue.empty():
                await _one(http, queue.get_nowait(), crng, server.model_name, tally)

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    return tally


def _disconnects(server: RunningServer) -> float:
    return scrape_metrics(server)[("minisgl_client_disconnects_total", ())]


def _rounds() -> int | None:
    return None if SECONDS > 0 else max(2, ROUNDS)


async def test_soak_mixed_traffic_answers_everything_and_leaks_nothing(server):
    rss: list[int] = []
    started = time.monotonic()
    i = 0
    while True:
        disconnects = _disconnects(server)
        tally = await _round(server, seed=1000 + i)
        five_xx = {s: n for s, n in tally.statuses.items() if s >= 500}
        assert not tally.failures, (
            f"round {i}: {len(tally.failures)} failures, e.g. {tally.failures[:5]}; "
            f"kinds {dict(tally.kinds)}; statuses {dict(tally.statuses)}"
        )
        assert five_xx == {}, f"round {i}: server errors {five_xx}"
        await asyncio.to_thread(server.wait_zero, 2.0)
        # the disconnecting clients really left mid-request (not all were too slow to)
        assert _disconnects(server) > disconnects, "no client disconnect reached the server"
        rss.append(group_rss_bytes(server))
        print(
            f"round {i}: {dict(tally.kinds)} statuses {dict(tally.statuses)} rss {rss[-1] / MB:.0f} MB"
        )
        i += 1
        if (rounds := _rounds()) is not None and i >= rounds:
            break
        if rounds is None and i >= 3 and time.monotonic() - started >= SECONDS:
            break
    assert server.proc.poll() is None, "the server died"
    assert "Traceback" not in server.log(), server.log()[-3000:]

    # Round 0 warms up: allocator arenas, torch's CPU caching allocator, the KV pages that
    # the peak of 64 requests touches first (free pages are reused last-in first-out, so
    # later rounds touch no new ones), tokenizer caches, uvicorn's buffers. After it the
    # three processes together hold about 900 MB and move by allocator noise of a few MB
    # (2 MB measured over five rounds). The bound, 2% + 20 MB over the first measured round
    # (about 38 MB), is ten times that noise, yet a leak of 12 KB per request (a kept reply
    # buffer, token array or decode state; one KV page is 16 tokens x 512 B = 8 KB) over
    # the 3,600 requests from the first to the last measured round (43 MB) passes it; more
    # rounds (MINISGL_SOAK_ROUNDS) catch smaller leaks. Leaked per-request state of any size
    # is what the /debug/lifecycle check after every round catches.
    first, last = rss[1], rss[-1]
    assert last <= first * 1.02 + 20 * MB, (
        f"resident memory grew across rounds (MB): {[round(r / MB) for r in rss]}"
    )
