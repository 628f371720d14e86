"""The processes of the frontend benchmark (benchmarks/frontend.py), one entry point each.

- `serve_ours`: the real API server, `create_app` + `FrontendManager` under uvicorn, over
  the real ZMQ channels of `IpcChannels`, built as `minisgl/server/launch.py` builds it.
- `run_tokenizer`: the real tokenizer worker (`tokenize_worker`).
- `standin_scheduler`: the scheduler's place on the channels, without a model.
- `serve_bare`: a plain ASGI app under uvicorn sending the same SSE bytes.
- `client_main`: the load generator (httpx async streaming), measuring on command.

Every entry point takes the CPU set it is pinned to (None: not pinned). `chat_request` is
the one request body every stream sends, to ours and to bare alike.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time

from common import cpu_seconds, machine_busy_seconds

from minisgl.models.default_model import DEFAULT_MODEL_NAME

MODEL_NAME = DEFAULT_MODEL_NAME  # the name both servers answer with (no model is loaded)
WORD = " hello"  # one token in SmolLM2's tokenizer; what every stand-in token decodes to
SSE_HEADERS = [  # what minisgl's StreamResponse sends
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def pin(cpus: set[int] | None) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def chat_request(max_tokens: int) -> dict:
    """A streamed chat completion of `max_tokens` tokens, EOS ignored."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def uvicorn_config(app, port: int, loop: str, http: str):
    import uvicorn

    # the same settings for both servers; log level warning: no access-log line per request
    return uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop=loop,
        http=http,
        log_level="warning",
        access_log=False,
        lifespan="on",
        workers=1,
    )


# ============================================================================ bare server
def bare_chunks(model: str, n: int, word: str) -> list[bytes]:
    """The bodies of the `n` ASGI sends minisgl's StreamResponse makes for `n` tokens of
    `word` delivered one per wake-up: the first chunk carries the role, the last send also
    carries the finish chunk and [DONE]. Plain json, no minisgl code."""
    cid = "chatcmpl-" + os.urandom(16).hex()
    created = int(time.time())

    def event(delta: dict, finish: str | None) -> bytes:
        obj = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    first = event({"role": "assistant", "content": word}, None)
    middle = event({"content": word}, None)
    end = event({}, "length") + b"data: [DONE]\n\n"
    if n == 1:
        return [first + end]
    return [first] + [middle] * (n - 2) + [middle + end]


def make_bare_app(model: str, word: str):
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":  # a cancelled client, at the end of a point
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        n = json.loads(body)["max_tokens"]
        rid = os.urandom(16).hex().encode()  # ours sends an x-request-id of this size
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*SSE_HEADERS, (b"x-request-id", rid)],
            }
        )
        chunks = bare_chunks(model, n, word)
        for i, chunk in enumerate(chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1}
            )

    return app


def serve_bare(port: int, loop: str, http: str, cpus) -> None:
    import uvicorn

    pin(cpus)
    # a client that goes away mid-stream makes asyncio warn once per connection
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    uvicorn.Server(uvicorn_config(make_bare_app(MODEL_NAME, WORD), port, loop, http)).run()


# ============================================================================ ours
def serve_ours(port: int, channels, loop: str, http: str, cpus) -> None:
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.args import ServerArgs
    from minisgl.server.launch import connect_frontend

    pin(cpus)
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # as for bare
    args = ServerArgs(port=port, log_level="warning")
    app = create_app(args, MODEL_NAME, connect_frontend(channels, args))
    uvicorn.Server(uvicorn_config(app, port, loop, http)).run()


def run_tokenizer(args, model_dir, channels, ready, cpus) -> None:
    from minisgl.server.workers import tokenize_worker

    pin(cpus)
    tokenize_worker(args, model_dir, channels, ready)


def standin_scheduler(channels, token_id: int, step_s, emitted, ready, cpus) -> None:
    """The tests' `FakeScheduler` on the real channels: every running request gets one
    token per step, and a step's tokens go out in one frame, the way the real scheduler's
    `run_forever` sends them. `step_s` (a shared double) is the least time per step, 0: as
    fast as it can; `emitted` (a shared counter) counts the tokens sent."""
    from minisgl.message import BackendMsg, TokenizerMsg
    from minisgl.testing.fakes import FakeScheduler
    from minisgl.utils.worker import ParentWatch, Serving, run_worker
    from minisgl.utils.zmq import PullQueue, PushQueue

    pin(cpus)

    def serve(inbox, scheduler: FakeScheduler, parent: ParentWatch) -> None:
        next_step = time.perf_counter()
        while True:
            msgs = inbox.get(timeout_ms=0 if scheduler.running else 500)
            scheduler.handle(msgs)
            step = step_s.value
            if scheduler.running and step > 0:
                now = time.perf_counter()
                if now < next_step:
                    time.sleep(next_step - now)
                # catch up after a late wake-up, but keep steps at least half a step apart
                next_step = max(next_step + step, time.perf_counter() + step / 2)
            emitted.value += scheduler.step(token_id)
            if not msgs and not scheduler.running and not parent.alive():
                return

    def build(parent: ParentWatch) -> Serving:
        inbox = PullQueue(channels.scheduler, BackendMsg)
        scheduler = FakeScheduler(PushQueue(channels.tokenizer, TokenizerMsg).put)
        return Serving(functools.partial(serve, inbox, scheduler, parent))

    run_worker("standin", "stand-in scheduler", "warning", build, ready)


# ============================================================================ client
class Tally:
    """Counts SSE content chunks and tokens (occurrences of the token's text) in a byte
    stream that the network cuts anywhere."""

    CONTENT = b'"content":'

    def __init__(self, word: bytes) -> None:
        self.word = word
        self.tail_c = self.tail_w = b""

    def feed(self, data: bytes) -> tuple[int, int]:
        c, w = self.tail_c + data, self.tail_w + data
        self.tail_c, self.tail_w = c[-(len(self.CONTENT) - 1) :], w[-(len(self.word) - 1) :]
        return c.count(self.CONTENT), w.count(self.word)


async def measure(
    url: str,
    concurrency: int,
    max_tokens: int,
    warmup: int,
    target: int,
    pids: dict[str, int],
    max_seconds: float = 600.0,
    emitted=None,
) -> dict:
    """`concurrency` streams in a closed loop (a stream that ends starts the next request);
    the time for `target` tokens after `warmup` tokens (or until `max_seconds`), and the
    CPU seconds of `pids` and of the whole machine meanwhile."""
    import httpx

    body = chat_request(max_tokens)
    n = {"chunks": 0, "tokens": 0, "requests": 0, "errors": 0, "short": 0}
    mark: dict = {}
    done = asyncio.Event()

    def snapshot() -> dict:
        return {
            "t": time.perf_counter(),
            **n,
            "busy": machine_busy_seconds(),
            "emitted": emitted.value if emitted is not None else 0,
            "cpu": {k: cpu_seconds(p) for k, p in pids.items()},
        }

    async def stream(client) -> None:
        while not done.is_set():
            tally, tokens = Tally(WORD.encode()), 0
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        n["errors"] += 1
                        await r.aread()
                        await asyncio.sleep(0.01)
                        continue
                    async for data in r.aiter_raw():
                        c, w = tally.feed(data)
                        n["chunks"] += c
                        n["tokens"] += w
                        tokens += w
                        if "start" not in mark:
                            if n["tokens"] >= warmup:
                                mark["start"] = snapshot()
                        elif n["tokens"] - mark["start"]["tokens"] >= target:
                            mark.setdefault("end", snapshot())
                            done.set()
                            return
            except httpx.HTTPError:
                n["errors"] += 1
                continue
            n["requests"] += 1
            n["short"] += tokens != max_tokens

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:
        tasks = [asyncio.create_task(stream(client)) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(done.wait(), timeout=max_seconds)
        except asyncio.TimeoutError:
            mark.setdefault("start", snapshot())
            mark["end"] = snapshot()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    a, b = mark["start"], mark["end"]
    secs = b["t"] - a["t"]
    cpu = {k: 100 * (b["cpu"][k] - a["cpu"][k]) / secs for k in pids}
    machine = 100 * (b["busy"] - a["busy"]) / secs
    tokens, chunks = b["tokens"] - a["tokens"], b["chunks"] - a["chunks"]
    return {
        "seconds": secs,
        "tokens": tokens,
        "chunks": chunks,
        "requests": b["requests"] - a["requests"],
        "tokens_per_s": tokens / secs,
        "chunks_per_s": chunks / secs,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "emitted_per_s": (b["emitted"] - a["emitted"]) / secs,
        "cpu_pct": cpu,
        # busy CPU of processes that are not part of this benchmark (a shared machine)
        "others_cpu_pct": machine - sum(cpu.values()),
        "errors": n["errors"],
        "short_requests": n["short"],  # ended without max_tokens tokens (none expected)
    }


def client_main(conn, emitted, cpus) -> None:
    pin(cpus)
    while (cmd := conn.recv()) is not None:
        try:
            conn.send(("ok", asyncio.run(measure(**cmd, emitted=emitted))))
        except Exception as exc:  # report it and keep serving
            conn.send(("error", repr(exc)))
