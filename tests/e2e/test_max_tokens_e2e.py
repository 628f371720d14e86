"""`max_tokens` against the context, over the real server (the protocol tests' tiny Llama,
2048-token context): the prompt plus max_tokens must fit, as vLLM, SGLang and OpenAI
require. One token more than the room left is a 400 (`context_length_exceeded`, naming the
parameter as the endpoint calls it: `max_tokens`, `max_completion_tokens`,
`max_output_tokens`) on chat, completions and responses, streamed or not, with n > 1 and
for one prompt of several; exactly the room left is served to the last token of the
context; max_tokens left out is "up to the context". The `server` fixture checks that
/debug/lifecycle is back at zero after each test, the refused requests' included."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import PROTOCOL_SERVER, assert_error_body
from protocol_helpers import hf_tokenizer

pytestmark = pytest.mark.server(PROTOCOL_SERVER)

CONTEXT = 2048
# long prompts, so that the room left (and a request that fills it) is short
WORDS = "The capital of France is Paris. " * 270  # about 1900 tokens
MESSAGES = [{"role": "user", "content": WORDS}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.base_url + path, json={"model": server.model_name, **body}, timeout=120
    )


def _prompt_tokens(server, endpoint: str) -> int:
    """The prompt's tokens, as the server counts them (a request for one token)."""
    if endpoint == "completions":
        return len(hf_tokenizer(server.model_name).encode(WORDS))
    path, body = REQUESTS[endpoint](1)
    usage = _post(server, path, body).json()["usage"]
    return usage["input_tokens"] if endpoint == "responses" else usage["prompt_tokens"]


REQUESTS = {
    "chat": lambda m: ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": m}),
    "chat_new_name": lambda m: (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": m},
    ),
    "completions": lambda m: ("/v1/completions", {"prompt": WORDS, "max_tokens": m}),
    "responses": lambda m: ("/v1/responses", {"input": WORDS, "max_output_tokens": m}),
}
PARAM = {
    "chat": "max_tokens",
    "chat_new_name": "max_completion_tokens",
    "completions": "max_tokens",
    "responses": "max_output_tokens",
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", list(REQUESTS))
def test_one_token_past_the_context_left_is_a_400_naming_the_limit(server, endpoint, stream):
    prompt = _prompt_tokens(server, endpoint)
    room = CONTEXT - prompt
    assert 0 < room < 200, prompt
    for n in (1, 2) if endpoint != "responses" else (1,):  # responses has no n
        path, body = REQUESTS[endpoint](room + 1)
        extra = {"n": n} if n > 1 else {}
        r = _post(server, path, {**body, **extra, "stream": stream, "ignore_eos": True})
        assert r.status_code == 400, r.text  # a real status, for a stream too: nothing sent
        error = assert_error_body(r.json(), "context_length_exceeded")
        assert error["param"] == PARAM[endpoint], error
        assert f"context is {CONTEXT} tokens" in error["message"]
        assert f"prompt has {prompt}" in error["message"] and f"at most {room} " in error["message"]


@pytest.mark.parametrize("endpoint", list(REQUESTS))
def test_exactly_the_context_left_is_served_to_its_last_token(server, endpoint):
    prompt = _prompt_tokens(server, endpoint)
    path, body = REQUESTS[endpoint](CONTEXT - prompt)
    r = _post(server, path, {**body, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    if endpoint == "responses":
        assert r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
        assert usage["input_tokens"] + usage["output_tokens"] == CONTEXT
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_max_tokens_left_out_generates_up_to_the_context(server, endpoint):
    path, body = REQUESTS[endpoint](None)
    r = _post(server, path, {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    total = usage.get("total_tokens")
    assert total == CONTEXT, usage


def test_one_prompt_of_several_past_the_context_left_refuses_the_request(server):
    """Each prompt of a completions request is its own request scope: one that cannot fit
    refuses the whole HTTP request, and the others leave nothing behind."""
    tok = hf_tokenizer(server.model_name)
    room = CONTEXT - len(tok.encode(WORDS))
    r = _post(
        server,
        "/v1/completions",
        {"prompt": ["short", WORDS], "max_tokens": room + 1, "ignore_eos": True},
    )
    assert r.status_code == 400, r.text
    assert assert_error_body(r.json(), "context_length_exceeded")["param"] == "max_tokens"
