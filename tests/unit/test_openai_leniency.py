"""What the official API accepts, accepted; what it refuses, refused: the API server over
a fake tokenizer worker (test_frontend_http.py's harness), so each case costs milliseconds.

- `null` for an optional parameter is its default, on both endpoints and inside messages;
- official fields that change nothing here (store, metadata, ...) are accepted and ignored,
  an assistant message sent back as the client's `model_dump()` is accepted, and a name
  nobody defines is still a 400 naming it;
- content parts we cannot serve are a 400 that names the part; text parts with extra keys
  are served;
- the model card (`GET /v1/models/{id}`) with `max_model_len`;
- the peer extensions reach the tokenizer worker's TokenizeMsg: chat_template_kwargs,
  add_generation_prompt, continue_final_message, reasoning_effort; continuous usage stats
  put the usage so far on every chunk; with --reasoning-parser a prompt that opened the
  think block makes the answer's start reasoning.
"""

from __future__ import annotations

import json

import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_frontend_http import MODEL, PIECES, PROMPT_TOKENS, assert_error_body, chat, script
from test_frontend_http import serving as _serving

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.args import ServerArgs
from minisgl.testing.fakes import make_frontend
from minisgl.testing.sse import sse_chunks

# every parameter OpenAI marks nullable, sent as null
NULLS = {
    "chat": [
        "n", "temperature", "top_p", "stream", "stream_options", "logprobs", "top_logprobs",
        "presence_penalty", "frequency_penalty", "parallel_tool_calls", "stop", "max_tokens",
        "max_completion_tokens", "seed", "user", "logit_bias", "response_format", "tools",
        "tool_choice", "store", "metadata", "service_tier", "reasoning_effort", "modalities",
        "verbosity", "prediction", "prompt_cache_key", "safety_identifier", "audio",
    ],
    "completions": [
        "n", "temperature", "top_p", "stream", "stream_options", "logprobs", "echo", "best_of",
        "presence_penalty", "frequency_penalty", "stop", "max_tokens", "seed", "user",
        "logit_bias", "suffix",
    ],
}  # fmt: skip
DEFAULTS = SamplingParams(max_tokens=None)

# official fields that change nothing a self-hosted server generates
IGNORED = {
    "store": True,
    "metadata": {"team": "docs"},
    "service_tier": "auto",
    "prompt_cache_key": "user-42",
    "prompt_cache_retention": "24h",
    "safety_identifier": "hash-123",
    "user": "u1",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "Hello"},
    "stream_options": {"include_usage": True, "include_obfuscation": False},
}


async def post(body: dict, path: str = "/v1/chat/completions", **options):
    """POST `body` against a fake backend that answers PIECES; (response, TokenizeMsgs)."""
    frontend, backend = make_frontend()
    script(backend, PIECES)
    async with _serving(frontend, **options) as client:
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as resp:
                await resp.aread()
        else:
            resp = await client.post(path, json=body)
    return resp, backend.tokenized()


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "hi", **extra}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_null_for_every_nullable_parameter_means_its_default(endpoint):
    body = chat if endpoint == "chat" else completion
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    resp, (msg,) = await post(body(**dict.fromkeys(NULLS[endpoint])), path)
    assert resp.status_code == 200, resp.text
    _, (plain,) = await post(body(), path)
    assert msg.sampling_params == plain.sampling_params  # exactly as if left out
    if endpoint == "chat":
        assert msg.sampling_params.max_tokens is DEFAULTS.max_tokens
    else:
        assert msg.sampling_params.max_tokens == 16  # OpenAI's completions default


async def test_null_inside_messages_and_tools_means_the_default():
    messages = [
        {"role": "system", "content": "be brief", "name": None},
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hello", "tool_calls": None, "name": None},
        {"role": "user", "content": "again"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}]  # fmt: skip
    resp, (msg,) = await post(chat(messages=messages, tools=tools, tool_choice="none"))
    assert resp.status_code == 200, resp.text
    assert [m["content"] for m in msg.messages] == ["be brief", "hi", "hello", "again"]


@pytest.mark.parametrize("field", list(IGNORED))
async def test_official_fields_that_change_nothing_are_accepted(field):
    resp, (msg,) = await post(chat(stream=field == "stream_options", **{field: IGNORED[field]}))
    assert resp.status_code == 200, resp.text
    _, (plain,) = await post(chat())
    assert msg.sampling_params == plain.sampling_params


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"frobnicate": 1}, "frobnicate"),  # nobody defines it
        ({"stream_options": {"include_usage": True, "shout": True}}, "stream_options.shout"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"verbosity": "loud"}, "verbosity"),
        ({"metadata": {"n": 1}}, "metadata.n"),
    ],
)
async def test_what_openai_refuses_is_still_a_400_naming_it(extra, param):
    resp, sent = await post(chat(stream="stream_options" in extra, **extra))
    assert resp.status_code == 400, resp.text
    error = assert_error_body(resp.json(), param=param)
    assert param.split(".")[0] in error["message"] and sent == []


# an assistant answer as `response.choices[0].message.model_dump()` gives it back
DUMPED = {
    "content": "Let me check.",
    "refusal": None,
    "role": "assistant",
    "annotations": [],
    "audio": None,
    "function_call": None,
    "tool_calls": [
        {
            "id": "call_1",
            "function": {"arguments": '{"city": "Paris"}', "name": "get_weather"},
            "type": "function",
        }
    ],
    "reasoning_content": "The user wants the weather.",
}


async def test_an_assistant_message_dumped_by_the_client_is_accepted():
    messages = [
        {"role": "user", "content": "weather?"},
        DUMPED,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    resp, (msg,) = await post(chat(messages=messages))
    assert resp.status_code == 200, resp.text
    assistant = msg.messages[1]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert assistant["reasoning_content"] == "The user wants the weather."  # templates read it
    assert "audio" not in assistant and "refusal" not in assistant


@pytest.mark.parametrize(
    "names", [("reasoning",), ("reasoning", "reasoning_content")], ids=["new", "both"]
)
async def test_an_assistant_message_sent_back_with_vllms_reasoning_names_is_accepted(names):
    """A message dumped from an answer of this server (or vLLM's) carries `reasoning`, and
    `reasoning_content` too: the template gets the thinking under the name templates read."""
    sent = {k: v for k, v in DUMPED.items() if k != "reasoning_content"}
    sent |= {name: "The user wants the weather." for name in names}
    messages = [{"role": "user", "content": "weather?"}, sent]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    resp, (msg,) = await post(chat(messages=messages))
    assert resp.status_code == 200, resp.text
    assert msg.messages[1]["reasoning_content"] == "The user wants the weather."
    assert "reasoning" not in msg.messages[1]


@pytest.mark.parametrize("field", ["audio", "function_call"])
async def test_an_assistant_message_with_audio_or_a_function_call_is_refused(field):
    value = {"id": "audio_1"} if field == "audio" else {"name": "f", "arguments": "{}"}
    messages = [{"role": "user", "content": "hi"}, {**DUMPED, field: value}]
    resp, sent = await post(chat(messages=messages))
    assert resp.status_code == 400 and sent == []
    assert field in assert_error_body(resp.json())["param"]


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
    ],
)
async def test_a_content_part_this_model_cannot_read_is_a_400_naming_it(part, kind):
    messages = [
        {"role": "user", "content": "first"},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, part]},
    ]
    resp, sent = await post(chat(messages=messages))
    assert resp.status_code == 400 and sent == []
    error = assert_error_body(resp.json(), param="messages[1].content[1]")
    assert error["message"] == (
        f"messages[1].content[1]: {kind} parts are not supported by this text-only model"
    )


async def test_text_parts_with_extra_keys_are_served():
    content = [
        {"type": "text", "text": "Hello, ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "world"},
    ]
    resp, (msg,) = await post(chat(messages=[{"role": "user", "content": content}]))
    assert resp.status_code == 200, resp.text
    assert msg.messages[0]["content"] == "Hello, world"


# ---------------------------------------------------------------- the model card
async def test_the_model_card_names_the_model_and_its_context():
    frontend, _ = make_frontend()
    async with _serving(frontend, max_model_len=2048) as client:
        card = (await client.get(f"/v1/models/{MODEL}")).json()
        listed = (await client.get("/v1/models")).json()["data"]
        missing = await client.get("/v1/models/gpt-9")
        slashed = await client.get("/v1/models/org/other-model")
    Model.model_validate(card)
    assert card["id"] == MODEL and card["max_model_len"] == 2048 and listed == [card]
    assert missing.status_code == 404 and slashed.status_code == 404
    assert_error_body(missing.json(), "model_not_found", "model")


# ---------------------------------------------------------------- peer extensions
async def test_chat_template_fields_reach_the_tokenizer_worker():
    kwargs = {"enable_thinking": False, "custom": [1, 2]}
    _, (plain,) = await post(chat())
    assert plain.add_generation_prompt and not plain.continue_final_message
    assert plain.chat_template_kwargs is None
    _, (msg,) = await post(chat(chat_template_kwargs=kwargs, reasoning_effort="low"))
    assert msg.chat_template_kwargs == {"reasoning_effort": "low", **kwargs}
    _, (off,) = await post(chat(reasoning_effort="none"))
    assert off.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Par"}]
    _, (cont,) = await post(chat(messages=messages, continue_final_message=True))
    assert cont.continue_final_message and not cont.add_generation_prompt
    _, (bare,) = await post(chat(add_generation_prompt=False))
    assert not bare.add_generation_prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
async def test_inconsistent_template_fields_are_refused(extra, param):
    resp, sent = await post(chat(**extra))
    assert resp.status_code == 400 and sent == []
    assert_error_body(resp.json(), param=param)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = (chat if endpoint == "chat" else completion)(stream=True, stream_options=options)
    frontend, backend = make_frontend()
    script(backend, PIECES)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with _serving(frontend) as client:
        async with client.stream("POST", path, json=body) as resp:
            raw = await resp.aread()
    chunks = sse_chunks(raw)
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(PIECES)
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {PROMPT_TOKENS}
    assert chunks[-1]["choices"] == []  # the include_usage chunk still comes last
    if endpoint == "chat":
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
    # without include_usage, as in vLLM, nothing changes
    body["stream_options"] = {"continuous_usage_stats": True}
    frontend, backend = make_frontend()
    script(backend, PIECES)
    async with _serving(frontend) as client:
        async with client.stream("POST", path, json=body) as resp:
            raw = await resp.aread()
    assert b'"usage"' not in raw


async def test_a_prompt_that_opened_the_think_block_makes_the_start_reasoning():
    frontend, backend = make_frontend()

    def on_tokenize(msg: TokenizeMsg) -> None:
        assert msg.reasoning == "deepseek-r1"
        backend.inject(
            UserReply(msg.uid, reasoning_open=True),  # the tokenizer worker's word
            UserReply(msg.uid, "Paris is in France.\n</think>\n\n", completion_tokens=8),
            UserReply(msg.uid, "Paris.", True, "stop", prompt_tokens=3, completion_tokens=10),
        )

    backend.on_tokenize = on_tokenize
    args = ServerArgs(reasoning_parser="deepseek-r1")
    async with _serving(frontend, args) as client:
        full = (await client.post("/v1/chat/completions", json=chat())).json()
    message = ChatCompletion.model_validate(full).choices[0].message
    assert message.content == "Paris."
    # vLLM's name now and its older one, so that clients of either generation read it
    assert message.model_extra["reasoning"] == "Paris is in France."
    assert message.model_extra["reasoning_content"] == "Paris is in France."
    assert full["usage"]["completion_tokens"] == 10  # the reasoning tokens count


async def test_a_constrained_answer_has_no_reasoning():
    frontend, backend = make_frontend()
    seen: list[TokenizeMsg] = []
    backend.on_tokenize = lambda msg: (
        seen.append(msg),
        backend.inject(UserReply(msg.uid, '{"a": 1}', True, "stop", completion_tokens=3)),
    )
    async with _serving(frontend, ServerArgs(reasoning_parser="qwen3")) as client:
        body = chat(response_format={"type": "json_object"})
        full = (await client.post("/v1/chat/completions", json=body)).json()
    assert seen[0].reasoning is None
    assert full["choices"][0]["message"]["content"] == '{"a": 1}'
    assert not {"reasoning", "reasoning_content"} & set(full["choices"][0]["message"])


def test_a_response_schema_forbids_the_properties_it_does_not_list():
    """xgrammar's strict default, which vLLM and SGLang use: pydantic's schemas leave
    additionalProperties unsaid, so a small model could add keys until max_tokens."""
    from minisgl.server.chat import ChatCompletionRequest

    def sent(schema: dict) -> dict:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        req = ChatCompletionRequest.model_validate(chat(response_format=fmt))
        return json.loads(req.sampling_params().json_schema)

    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner}, "$defs": {"D": inner}}
    closed = sent(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    opened = sent({**schema, "additionalProperties": True})
    assert opened["additionalProperties"] is True  # what the schema says, it keeps
    assert "additionalProperties" not in schema  # the request's own schema untouched
