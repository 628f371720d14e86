"""The lifecycle contract on the real server (tiny Llama, 2048-token context): concurrent
streams, client disconnects while streaming and while not, refused requests. After every
test /debug/lifecycle is back at zero in all three processes within a second."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2e_helpers import (
    CHAT_PATH,
    ServerSpec,
    assert_completed_stream,
    assert_error_body,
    chat_body,
    chat_url,
    chunk_text,
    raw_post,
    tokens_body,
    wait_state,
)

from minisgl.testing.sse import iter_payloads

MAX_SEQ_LEN = 2048
LONG = 1500  # tokens: a request that stays in flight for a while

pytestmark = pytest.mark.server(
    ServerSpec(
        "long_context_dir", ("--max-seq-len", str(MAX_SEQ_LEN), "--max-running-requests", "64")
    )
)


def _still_serves(server) -> None:
    r = httpx.post(chat_url(server), json=chat_body(server.model_name, max_tokens=3), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# ---------------------------------------------------------------- concurrency
PROMPTS = ["The capital of France is", "什么是 KV Cache？", "def forward(self, x):", "🚀 ✨"]
LENGTHS = [8, 24]


async def test_32_concurrent_streams_complete_correctly(server):
    combos = [(p, n) for p in PROMPTS for n in LENGTHS]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:

        async def reference(prompt: str, n: int) -> str:
            body = chat_body(server.model_name, prompt, max_tokens=n, temperature=0)
            r = await http.post(chat_url(server), json={**body, "ignore_eos": True})
            assert r.status_code == 200
            return r.json()["choices"][0]["message"]["content"]

        expected = {combo: await reference(*combo) for combo in combos}

        async def stream(prompt: str, n: int) -> bytes:
            body = chat_body(server.model_name, prompt, max_tokens=n, temperature=0)
            body.update(stream=True, ignore_eos=True)
            async with http.stream("POST", chat_url(server), json=body) as r:
                assert r.status_code == 200
                return b"".join([part async for part in r.aiter_raw()])

        jobs = [combos[i % len(combos)] for i in range(32)]
        raws = await asyncio.gather(*(stream(*job) for job in jobs))

    for job, raw in zip(jobs, raws):
        assert chunk_text(assert_completed_stream(raw)) == expected[job], job
    server.wait_zero(1.0)


async def test_usage_and_text_are_exact_when_the_tokenizer_falls_behind(server):
    """16 greedy requests at once: the tokenizer worker then receives several steps of one
    request in one batch; each must still count every token and emit its text once."""
    n = 300
    body = chat_body(server.model_name, "The capital of", max_tokens=n, temperature=0)
    body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=120) as http:
        alone = (await http.post(chat_url(server), json=body)).json()
        together = await asyncio.gather(
            *(http.post(chat_url(server), json=body) for _ in range(16))
        )
    assert alone["usage"]["completion_tokens"] == n
    for r in together:
        out = r.json()
        assert out["usage"]["completion_tokens"] == n
        assert out["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- client disconnects
def test_disconnect_mid_stream_frees_all_state(server):
    body = tokens_body(server, LONG, stream=True)
    with httpx.Client(timeout=30) as http, http.stream("POST", chat_url(server), json=body) as r:
        assert r.status_code == 200
        events = 0
        for payload in iter_payloads(r.iter_lines()):
            events += payload.startswith("{")
            if events == 2:
                state = server.lifecycle()
                assert state["scheduler"]["running"] == 1, state  # still generating
                break  # leaving the loop closes the connection (httpcore's stream is closed)
    server.wait_zero(1.0)
    _still_serves(server)


def test_disconnect_mid_non_stream_frees_all_state(server):
    sock = raw_post(server.port, CHAT_PATH, tokens_body(server, LONG))
    try:
        wait_state(server, lambda s: s["scheduler"]["running"] >= 1, timeout=20.0)
    finally:
        sock.close()
    server.wait_zero(1.0)
    _still_serves(server)


def test_early_exit_of_the_openai_stream_frees_all_state(server, client):
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            assert server.lifecycle()["scheduler"]["running"] == 1  # still generating
            break
    stream.close()
    server.wait_zero(1.0)


# ---------------------------------------------------------------- refused requests
@pytest.mark.parametrize("stream", [False, True])
def test_over_long_prompt_is_a_prompt_400(server, stream):
    body = chat_body(server.model_name, "x" * (MAX_SEQ_LEN + 50), max_tokens=4, stream=stream)
    start = time.monotonic()
    r = httpx.post(chat_url(server), json=body, timeout=30)
    assert time.monotonic() - start < 2.0
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    error = assert_error_body(r.json(), "context_length_exceeded")
    assert error["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("path", "prompt", "param"),
    [
        ("/v1/chat/completions", "chat", "messages"),
        ("/v1/completions", "text", "prompt"),
        ("/v1/completions", "token_ids", "prompt"),
    ],
    ids=["chat", "completions_text", "completions_ids"],
)
def test_over_long_prompt_names_the_prompt_field_of_each_endpoint(
    server, path, prompt, param, stream
):
    """The scheduler reports the error as a kind; the API server names the field the
    client actually sent: `messages` on chat, `prompt` on completions."""
    long_text = "x" * (MAX_SEQ_LEN + 50)
    if prompt == "chat":
        body = chat_body(server.model_name, long_text, max_tokens=4, stream=stream)
    else:
        value = long_text if prompt == "text" else [5] * (MAX_SEQ_LEN + 50)
        body = {"model": server.model_name, "prompt": value, "max_tokens": 4, "stream": stream}
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = assert_error_body(r.json(), "context_length_exceeded")
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(server, stream):
    r = httpx.post(
        chat_url(server), json={**chat_body("no-such-model"), "stream": stream}, timeout=30
    )
    assert r.status_code == 404
    error = assert_error_body(r.json(), "model_not_found")
    assert error["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_omitted_model_means_the_served_one(server, path):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(server.base_url + path, json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == server.model_name
    r = httpx.post(server.base_url + path, json={**body, "model": None}, timeout=30)
    assert r.status_code == 200, r.text


BAD_BODIES = {
    "malformed_json": (b'{"model": "m", "messages": [', None),
    "not_an_object": (b"[1, 2, 3]", None),
    "max_tokens_string": ({"max_tokens": "5"}, "max_tokens"),
    "temperature_string": ({"temperature": "0.5"}, "temperature"),
    "stream_string": ({"stream": "yes"}, "stream"),
    "messages_string": ({"messages": "hi"}, "messages"),
    "messages_empty": ({"messages": []}, "messages"),
    "role_unknown": ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "temperature_too_high": ({"temperature": 5.0}, "temperature"),
    "unknown_parameter": ({"frobnicate": 1}, "frobnicate"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_request_is_400_with_openai_error_body(server, case):
    patch, param = BAD_BODIES[case]
    if isinstance(patch, bytes):
        r = httpx.post(
            chat_url(server),
            content=patch,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    else:
        r = httpx.post(chat_url(server), json={**chat_body(server.model_name), **patch}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = assert_error_body(r.json())
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    if case == "unknown_parameter":
        assert "frobnicate" in error["message"]
