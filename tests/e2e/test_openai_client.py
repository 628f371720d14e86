"""The official `openai` client against the real three-process server (tiny Llama):
responses and chunks validate strictly against the client's types, usage counts are real,
greedy output is deterministic and the same streamed or not."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import ServerSpec, chat_body, chat_url, prompt_len
from openai.types.chat import ChatCompletion, ChatCompletionChunk

CHINESE = "什么是 KV Cache？"

pytestmark = pytest.mark.server(ServerSpec("llama"))


def _messages(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_non_streaming_completion_has_real_usage(server, client, tiny_dirs):
    messages = _messages("The capital of France is")
    resp = client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == server.model_name and isinstance(resp.created, int)
    (choice,) = resp.choices
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == prompt_len(tiny_dirs["llama"], messages)
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7


def test_finish_reason_is_stop_or_length_and_counts_agree(server, client):
    resp = client.chat.completions.create(
        model=server.model_name, messages=_messages("hello"), max_tokens=40
    )
    choice = resp.choices[0]
    assert choice.finish_reason in {"stop", "length"}
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 40
    else:
        assert 1 <= resp.usage.completion_tokens <= 40


def test_raw_json_validates_strictly(server):
    r = httpx.post(
        chat_url(server), json=chat_body(server.model_name, "hi", max_tokens=5), timeout=30
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    completion = ChatCompletion.model_validate(r.json(), strict=True)
    assert completion.usage is not None and completion.usage.completion_tokens >= 1


def test_streaming_chunks_validate_and_concatenate(server, client):
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=_messages("Streaming responses"),
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)  # the iterator ends: the stream was closed after [DONE]
    assert len(chunks) >= 2
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict(), strict=True)
        assert chunk.object == "chat.completion.chunk"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert isinstance(text, str) and text


def test_models_list_names_the_served_model(server, client):
    ids = [m.id for m in client.models.list()]
    assert ids == [server.model_name]


def test_greedy_is_deterministic_and_same_streamed_or_not(server, client):
    kwargs = dict(
        model=server.model_name,
        messages=_messages("def forward(self, x):"),
        max_tokens=24,
        temperature=0,
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens
    streamed = client.chat.completions.create(**kwargs, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        first.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason


def test_chinese_prompt_is_served(server, client, tiny_dirs):
    messages = _messages(CHINESE)
    resp = client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=8, temperature=0
    )
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.usage.prompt_tokens == prompt_len(tiny_dirs["llama"], messages)
    stream = client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == resp.choices[0].message.content
