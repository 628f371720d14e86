"""The API server over a fake tokenizer worker: wire format, errors and client disconnects.

The real FastAPI app from `create_app` runs under a real uvicorn server on a free port of
127.0.0.1, in the test's own event loop, so a test can close a connection mid-stream and
then watch the frontend send AbortMsg. The FakeBackend answers each TokenizeMsg with a
scripted list of UserReply messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import uvicorn
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minisgl.message import (
    ErrorInfo,
    ErrorKind,
    LifecycleQueryMsg,
    LifecycleStateMsg,
    SchedulerState,
    TokenizeMsg,
    UserReply,
)
from minisgl.server.api_server import create_app
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import FrontendManager
from minisgl.testing.fakes import FakeBackend, make_frontend, wait_until
from minisgl.testing.sse import DONE, sse_payloads

MODEL = "test-model"
PIECES = ["Hello", ", ", "鲸鱼 🐳", "!"]
PROMPT_TOKENS = 11
TOO_LONG = ErrorInfo(
    ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the prompt has 9000 tokens; this model's context is 2048"
)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # leave pytest's signal handlers alone
        yield


@contextlib.asynccontextmanager
async def serving(
    frontend: FrontendManager, args: ServerArgs | None = None, **app_options
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(args or ServerArgs(), MODEL, frontend, **app_options)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, lifespan="on", log_config=None, timeout_graceful_shutdown=1
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=5)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            yield client
    finally:
        server.should_exit = True
        await task


def script(backend: FakeBackend, pieces=(), *, end: UserReply | None = None, finish=True):
    """Answer each TokenizeMsg: one reply per piece (10 ms apart), then the terminal one
    (`end`, or a plain stop); `finish=False` leaves the request running forever."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def play(msg: TokenizeMsg) -> None:
        for i, piece in enumerate(pieces):
            backend.inject(
                UserReply(msg.uid, piece, prompt_tokens=PROMPT_TOKENS, completion_tokens=i + 1)
            )
            await asyncio.sleep(0.01)
        if end is not None:
            backend.inject(msgspec.structs.replace(end, uid=msg.uid))
        elif finish:
            backend.inject(
                UserReply(
                    msg.uid,
                    finished=True,
                    finish_reason="stop",
                    prompt_tokens=PROMPT_TOKENS,
                    completion_tokens=len(pieces),
                )
            )

    def on_tokenize(msg: TokenizeMsg) -> None:
        task = loop.create_task(play(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    backend.on_tokenize = on_tokenize


def chat(stream: bool = False, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


ANY = object()


def assert_error_body(body: dict, code=ANY, param=ANY) -> dict:
    """The OpenAI error shape; `code` and `param` are checked unless left as ANY."""
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not ANY:
        assert err["code"] == code
    if param is not ANY:
        assert err["param"] == param
    return err


# ---------------------------------------------------------------- the happy paths


async def test_streaming_response_is_valid_sse_of_openai_chunks_ending_in_done():
    frontend, backend = make_frontend()
    script(backend, PIECES)
    async with serving(frontend) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = await resp.aread()
        await wait_until(lambda: frontend.states == {})

    events = sse_payloads(raw)
    assert events[-1] == DONE
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].id.startswith("chatcmpl-") and {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(PIECES)
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].delta.content is None
    assert backend.aborts() == []


async def test_non_streaming_body_is_an_openai_chat_completion_with_real_usage():
    frontend, backend = make_frontend()
    script(backend, PIECES)
    async with serving(frontend) as client:
        resp = await client.post("/v1/chat/completions", json=chat())
        await wait_until(lambda: frontend.states == {})
    assert resp.status_code == 200
    completion = ChatCompletion.model_validate(resp.json())
    assert completion.id.startswith("chatcmpl-") and completion.model == MODEL
    assert completion.object == "chat.completion"
    (choice,) = completion.choices
    assert choice.message.role == "assistant" and choice.message.content == "".join(PIECES)
    assert choice.finish_reason == "stop"
    assert completion.usage.prompt_tokens == PROMPT_TOKENS
    assert completion.usage.completion_tokens == len(PIECES)
    assert completion.usage.total_tokens == PROMPT_TOKENS + len(PIECES)
    assert backend.aborts() == []


# ---------------------------------------------------------------- errors are answers


@pytest.mark.parametrize("stream", [False, True])
async def test_an_error_before_the_first_token_is_a_real_http_status(stream):
    frontend, backend = make_frontend()
    script(backend, end=UserReply(0, finished=True, error=TOO_LONG))
    async with serving(frontend) as client:
        resp = await client.post("/v1/chat/completions", json=chat(stream=stream))
        await wait_until(lambda: frontend.states == {})
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/json")
    err = assert_error_body(resp.json(), "context_length_exceeded", "messages")
    assert err["message"] == TOO_LONG.message and err["type"] == "invalid_request_error"
    assert backend.aborts() == []  # the error reply was terminal


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
async def test_a_workers_refusal_of_max_tokens_names_the_field_the_client_sent(name):
    """The tokenizer worker knows one name (SamplingParams'); the answer names the one the
    request used."""
    no_room = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "no room", "max_tokens")
    frontend, backend = make_frontend()
    script(backend, end=UserReply(0, finished=True, error=no_room))
    async with serving(frontend) as client:
        resp = await client.post("/v1/chat/completions", json=chat(**{name: 5000}))
        await wait_until(lambda: frontend.states == {})
    assert resp.status_code == 400
    assert_error_body(resp.json(), "context_length_exceeded", name)


async def test_an_error_after_streaming_began_is_an_error_event_then_done():
    frontend, backend = make_frontend()
    boom = ErrorInfo(ErrorKind.INTERNAL, "the tokenizer failed")
    script(backend, ["partial"], end=UserReply(0, finished=True, error=boom))
    async with serving(frontend) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp:
            assert resp.status_code == 200
            raw = await resp.aread()
    events = sse_payloads(raw)
    assert events[-1] == DONE
    assert_error_body(json.loads(events[-2]), "internal_error")
    for e in events[:-2]:
        ChatCompletionChunk.model_validate(json.loads(e))
    assert frontend.states == {} and backend.aborts() == []


BAD_REQUESTS = {
    "unknown_model": (chat(model="gpt-9"), 404, "model_not_found", "model"),
    "wrong_type": (chat(max_tokens="10"), 400, ANY, "max_tokens"),
    "unknown_parameter": (chat(functions=[{"name": "f"}]), 400, ANY, "functions"),
    "tool_without_function": (chat(tools=[{"type": "function"}]), 400, ANY, "tools.0.function"),
    "malformed_json": (b'{"model": "test-model", "messages": [', 400, None, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_a_bad_request_gets_an_openai_error_body_and_never_reaches_the_backend(case):
    body, status, code, param = BAD_REQUESTS[case]
    frontend, backend = make_frontend()
    async with serving(frontend) as client:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            resp = await client.post("/v1/chat/completions", content=body, headers=headers)
        else:
            resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == status
    err = assert_error_body(resp.json(), code, param)
    if param is not None:
        assert param in err["message"]  # the client is told what to fix
    assert backend.sent == []


async def test_a_dead_backend_answers_503_on_health_and_on_new_requests():
    frontend, backend = make_frontend()
    async with serving(frontend) as client:
        assert (await client.get("/health")).status_code == 200
        frontend.fail_all(ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, "the scheduler died"))
        health = await client.get("/health")
        resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert health.status_code == 503 and resp.status_code == 503
    assert_error_body(resp.json(), "backend_unavailable")
    assert backend.tokenized() == []


# the scheduler's counts as /debug/lifecycle names and orders them (outside checks read them)
SCHEDULER_JSON = {
    "pending": 1,
    "running": 2,
    "table_slots_used": 3,
    "kv_pages_used": 4,
    "kv_pages_total": 16,
    "kv_pages_cached": 5,
    "prefix_cache_nodes": 6,
    "prefix_cache_query_tokens": 70,
    "prefix_cache_hit_tokens": 30,
    "grammar_matchers": 1,
}


def answer_with(backend: FakeBackend, scheduler: SchedulerState, flushed: int | None = None):
    """The workers answer each state query with `scheduler`, plus `flushed` on a flush."""

    def on_query(msg: LifecycleQueryMsg) -> None:
        state = msgspec.structs.replace(scheduler)
        if msg.flush_cache and flushed is not None:
            state.flushed_pages = flushed
        backend.inject(LifecycleStateMsg(msg.query_id, {"decode_states": 0}, state))

    backend.on_query = on_query


async def test_debug_lifecycle_shows_the_workers_answer_as_json_with_unset_fields_left_out():
    frontend, backend = make_frontend()
    answer_with(backend, SchedulerState(**SCHEDULER_JSON))
    async with serving(frontend) as client:
        resp = await client.get("/debug/lifecycle")
    assert resp.status_code == 200
    assert resp.json() == {
        "frontend": {"requests": 0, "pending_bytes": 0},
        "tokenizer": {"decode_states": 0},
        "scheduler": SCHEDULER_JSON,  # no flushed_pages (no flush), no ranks (one rank)
    }
    assert list(resp.json()["scheduler"]) == list(SCHEDULER_JSON)


async def test_debug_lifecycle_with_ranks_shows_each_rank_with_its_rank_and_pid_first():
    frontend, backend = make_frontend()
    state = SchedulerState(**SCHEDULER_JSON)
    state.ranks = [state.on_rank(0, 100), state.on_rank(1, 101)]
    answer_with(backend, state)
    async with serving(frontend) as client:
        scheduler = (await client.get("/debug/lifecycle")).json()["scheduler"]
    assert list(scheduler) == [*SCHEDULER_JSON, "ranks"]
    assert scheduler["ranks"] == [
        {"rank": 0, "pid": 100, **SCHEDULER_JSON},
        {"rank": 1, "pid": 101, **SCHEDULER_JSON},
    ]
    assert [list(r) for r in scheduler["ranks"]] == [["rank", "pid", *SCHEDULER_JSON]] * 2


@pytest.mark.parametrize("flushed", [7, -1])
async def test_flush_cache_answers_the_pages_freed_or_409_when_the_scheduler_was_busy(flushed):
    frontend, backend = make_frontend()
    answer_with(backend, SchedulerState(**SCHEDULER_JSON), flushed=flushed)
    async with serving(frontend) as client:
        resp = await client.post("/debug/flush_cache")
    (query,) = backend.queries()
    assert query.flush_cache
    if flushed >= 0:
        assert resp.status_code == 200 and resp.json() == {"flushed_pages": flushed}
    else:
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "busy"


async def test_metrics_gauges_come_from_the_schedulers_answer():
    frontend, backend = make_frontend()
    answer_with(backend, SchedulerState(**SCHEDULER_JSON))
    async with serving(frontend) as client:
        first = (await client.get("/metrics")).text
        answer_with(backend, SchedulerState(**{**SCHEDULER_JSON, "prefix_cache_hit_tokens": 40}))
        second = (await client.get("/metrics")).text

    def metric(text: str, name: str) -> float:
        (line,) = [line for line in text.splitlines() if line.split(" ")[0] == name]
        return float(line.split(" ")[1])

    assert metric(first, "minisgl_requests_running") == 2
    assert metric(first, "minisgl_requests_pending") == 1
    assert metric(first, "minisgl_kv_pages_used") == 4
    assert metric(first, "minisgl_kv_pages_total") == 16
    assert metric(first, "minisgl_kv_cache_usage_perc") == 4 / 16
    assert metric(first, "minisgl_kv_pages_cached") == 5
    assert metric(first, "minisgl_prefix_cache_queries_total") == 70
    assert metric(first, "minisgl_prefix_cache_hits_total") == 30
    # the scheduler's totals grew by 10 hits: the counter advances by as much
    assert metric(second, "minisgl_prefix_cache_hits_total") == 40
    assert metric(second, "minisgl_prefix_cache_queries_total") == 70


# ---------------------------------------------------------------- client disconnects


async def _disconnect_mid_stream(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_raw():
            assert chunk.startswith(b"data: ")
            break  # leaving the block closes the connection with the stream unfinished


async def _disconnect_while_waiting(client: httpx.AsyncClient, backend: FakeBackend) -> None:
    post = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
    await wait_until(lambda: len(backend.tokenized()) == 1)
    await asyncio.sleep(0.05)  # the request now waits for output that never comes
    post.cancel()  # httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await post


@pytest.mark.parametrize("stream", [True, False], ids=["mid_stream", "non_streaming_wait"])
async def test_a_client_disconnect_aborts_the_request_and_frees_its_state(stream):
    frontend, backend = make_frontend()
    script(backend, ["first"] if stream else [], finish=False)  # the backend never finishes
    async with serving(frontend) as client:
        if stream:
            await _disconnect_mid_stream(client)
        else:
            await _disconnect_while_waiting(client, backend)
        (msg,) = backend.tokenized()
        await wait_until(lambda: backend.aborts() == [msg.uid] and frontend.states == {}, 1.0)
        backend.inject(UserReply(msg.uid, "late", completion_tokens=2))  # dropped quietly
        await asyncio.sleep(0.05)
        assert frontend.states == {} and backend.aborts() == [msg.uid]


@pytest.mark.parametrize("stream", [True, False], ids=["mid_stream", "non_streaming_wait"])
async def test_a_client_disconnect_is_not_logged_as_an_application_error(stream, caplog):
    frontend, backend = make_frontend()
    script(backend, ["first"] if stream else [], finish=False)
    caplog.set_level(logging.ERROR)
    async with serving(frontend) as client:
        if stream:
            await _disconnect_mid_stream(client)
        else:
            await _disconnect_while_waiting(client, backend)
        await wait_until(lambda: frontend.states == {}, 1.0)
        await asyncio.sleep(0.05)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [(r.getMessage(), r.exc_info and repr(r.exc_info[1])) for r in errors]
