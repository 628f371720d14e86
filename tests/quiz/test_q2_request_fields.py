"""Quiz question 2: where `messages`, `max_tokens` and `stream` go.

Checks exercise q2:
- `tokenize_msg(req, uid, tools)` equals, for a range of requests, the TokenizeMsg that the real
  route `v1_chat_completions` sends; and, spelled out, what it holds for `messages` and
  for either name of the token limit (`max_tokens`, `max_completion_tokens`);
- `frontend_only_fields()` names exactly the `ChatCompletionRequest` fields that reach no
  worker. The test finds them itself: it varies each field of the request model in turn
  and looks whether the real route's message changes.

About minisgl itself: the response objects the route builds for `stream: true` and
`false` and the messages they would send; the message that reaches the FakeBackend
through the real app either way; the answer to fields it has no place for.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import pytest
from fastapi import FastAPI
from quiz_helpers import MODEL, answer, app_client, app_for, chat_body
from starlette.requests import Request

from minisgl.message import TokenizeMsg
from minisgl.server.chat import ChatCompletionRequest, v1_chat_completions
from minisgl.server.response import FullResponse, StreamResponse
from minisgl.testing.fakes import make_frontend, wait_until

pytestmark = pytest.mark.q2

MESSAGES = [
    {"role": "developer", "content": "用中文回答。"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "什么是 "}, {"type": "text", "text": "KV Cache？"}],
    },
]

TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}

# every field of the request model: the extra fields of two requests that differ in it
# alone (both carry what the field needs, e.g. `stream` for `stream_options`)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "model": ({}, {"model": "another-model"}),  # served by an app of that name
    "messages": ({}, {"messages": [{"role": "user", "content": "另一个问题"}]}),
    "max_tokens": ({}, {"max_tokens": 8}),
    "max_completion_tokens": ({}, {"max_completion_tokens": 8}),
    "temperature": ({}, {"temperature": 0.5}),
    "top_p": ({}, {"top_p": 0.5}),
    "n": ({}, {"n": 2}),
    "stop": ({}, {"stop": "\n"}),
    "seed": ({}, {"seed": 7}),
    "stream": ({}, {"stream": True}),
    "stream_options": (
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
    ),
    "presence_penalty": ({}, {"presence_penalty": 0.5}),
    "frequency_penalty": ({}, {"frequency_penalty": 0.5}),
    "logit_bias": ({}, {"logit_bias": {"5": 1.0}}),
    "user": ({}, {"user": "learner-42"}),
    "top_k": ({}, {"top_k": 5}),
    "min_tokens": ({}, {"min_tokens": 2}),
    "ignore_eos": ({}, {"ignore_eos": True}),
    "stop_token_ids": ({}, {"stop_token_ids": [3]}),
    "repetition_penalty": ({}, {"repetition_penalty": 1.1}),
    "cache_salt": ({}, {"cache_salt": "tenant-a"}),
    "logprobs": ({}, {"logprobs": True}),
    "top_logprobs": ({"logprobs": True}, {"logprobs": True, "top_logprobs": 2}),
    "response_format": ({}, {"response_format": {"type": "text"}}),
    "tools": ({}, {"tools": [TOOL]}),
    "tool_choice": ({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "none"}),
    "parallel_tool_calls": (
        {"tools": [TOOL], "tool_choice": "required"},
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    ),
    "reasoning_effort": ({}, {"reasoning_effort": "low"}),
    "chat_template_kwargs": ({}, {"chat_template_kwargs": {"enable_thinking": False}}),
    "add_generation_prompt": ({}, {"add_generation_prompt": False}),
    "continue_final_message": ({}, {"continue_final_message": True}),
    # official fields a self-hosted server has no use for
    "store": ({}, {"store": True}),
    "metadata": ({}, {"metadata": {"team": "docs"}}),
    "service_tier": ({}, {"service_tier": "auto"}),
    "prompt_cache_key": ({}, {"prompt_cache_key": "learner-42"}),
    "prompt_cache_retention": ({}, {"prompt_cache_retention": "24h"}),
    "safety_identifier": ({}, {"safety_identifier": "hash-42"}),
    "verbosity": ({}, {"verbosity": "low"}),
    "prediction": ({}, {"prediction": {"type": "content", "content": "KV"}}),
    "modalities": ({}, {"modalities": ["text"]}),
    "audio": ({}, {"audio": None}),  # only null is served
}

REQUESTS = {
    "developer_and_text_parts": {},
    "max_tokens": {"max_tokens": 128},
    "max_completion_tokens": {"max_completion_tokens": 64},
    "stop_as_one_string": {"stop": "\n\n", "n": 2, "seed": 7},
    "sampling_extensions": {"top_k": 20, "min_tokens": 3, "stop_token_ids": [1, 2]},
    "logprobs": {"logprobs": True, "top_logprobs": 3, "temperature": 0.0},
    "streamed": {"stream": True, "stream_options": {"include_usage": True}, "user": "u"},
    "tools": {"tools": [TOOL], "tool_choice": "required"},
    "template_fields": {
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "none",
    },
    "continued": {"continue_final_message": True},
}


def parse(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, **fields})


@functools.cache
def chat_app(model: str) -> FastAPI:
    frontend, _ = make_frontend()
    return app_for(frontend, model)


async def route_response(req: ChatCompletionRequest):
    """What the chat route (a module-level function) answers `req` with, in an app."""
    scope = {"type": "http", "app": chat_app(req.model), "headers": []}
    return await v1_chat_completions(req, Request(scope))


def tools_of(req: ChatCompletionRequest):
    """The request's tool-call format, as the route makes it (the app's parsers)."""
    return chat_app(req.model).state.parsers.tool_calls(req.tool_calling())


async def message_of_the_route(req: ChatCompletionRequest, uid: int) -> TokenizeMsg:
    """The TokenizeMsg that minisgl's chat route would send for `req` under `uid`."""
    return (await route_response(req)).job.make_msgs[0](uid)


# ---------------------------------------------------------------- exercise q2


@pytest.mark.parametrize("fields", REQUESTS.values(), ids=REQUESTS.keys())
async def test_your_message_is_the_one_the_chat_route_sends(exercise, fields):
    req = parse(**fields)
    mine = exercise.tokenize_msg(req, 7, tools_of(req))
    assert isinstance(mine, TokenizeMsg), f"tokenize_msg 必须返回一个 TokenizeMsg，而不是 {mine!r}"
    assert mine == await message_of_the_route(req, 7), (
        "你的 TokenizeMsg 和聊天路由为这个请求发给 Tokenizer Worker 的那条不一样"
        "（下面的比较显示了差在哪里）"
    )


def test_messages_become_the_chat_template_input(exercise):
    msg = exercise.tokenize_msg(parse(), 3, None)
    assert msg.uid == 3, "消息必须带着请求的 uid"
    assert msg.messages == [
        {"role": "system", "content": "用中文回答。"},  # the template's name for "developer"
        {"role": "user", "content": "什么是 KV Cache？"},  # text parts joined
    ], (
        "`messages` 必须作为聊天模板的输入到达 Tokenizer Worker：每条消息的 "
        "ChatMessage.as_template_input()（developer 改为 system，文本分段拼接）"
    )
    assert msg.text is None and msg.input_ids_packed is None, (
        "聊天请求只带 messages：prompt 由 worker 的聊天模板构造"
    )


def test_either_name_of_max_tokens_reaches_the_scheduler(exercise):
    for name in ("max_tokens", "max_completion_tokens"):
        got = exercise.tokenize_msg(parse(**{name: 64}), 0, None).sampling_params.max_tokens
        assert got == 64, f"`{name}: 64` 必须作为 SamplingParams.max_tokens 到达 Scheduler"
    got = exercise.tokenize_msg(parse(), 0, None).sampling_params.max_tokens
    assert got is None, "没有给上限时由 Scheduler 决定（用剩下的空间）：max_tokens 为 None"


async def test_the_fields_you_name_are_exactly_those_that_reach_no_worker(exercise):
    named = exercise.frontend_only_fields()
    assert set(VARIANTS) == set(ChatCompletionRequest.model_fields), (
        "每个字段都要改变一次：VARIANTS 必须覆盖请求模型的全部字段"
    )
    silent = set()  # fields whose change changes no message
    for field, (base, varied) in VARIANTS.items():
        before = await message_of_the_route(parse(**base), 0)
        after = await message_of_the_route(parse(**varied), 0)
        if before == after:
            silent.add(field)
    reaching = sorted(set(named) - silent)
    assert not reaching, "这些字段确实会改变发给 Tokenizer Worker 的消息"
    missing = silent - set(named)
    if missing:  # not named here: finding them is the exercise
        pytest.fail(f"ChatCompletionRequest 还有 {len(missing)} 个字段永远到不了 worker")


# ---------------------------------------------------------------- minisgl


async def test_minisgl_stream_picks_the_response_object_and_is_not_sent():
    streamed = await route_response(parse(stream=True, max_tokens=128))
    full = await route_response(parse(stream=False, max_tokens=128))
    assert type(streamed) is StreamResponse and type(full) is FullResponse
    # building the response sent nothing: the request starts when Starlette calls it
    assert streamed.frontend.states == {}
    # the message each one would send differs in nothing: stream stays in the frontend
    assert streamed.job.make_msgs[0](7) == full.job.make_msgs[0](7)


@pytest.mark.parametrize("stream", [False, True])
async def test_minisgl_through_the_real_app_the_worker_receives_the_same_message(stream):
    frontend, backend = make_frontend()
    answer(backend, ["KV", " Cache"])
    async with app_client(frontend) as client:
        body = {**chat_body(stream, max_tokens=128), "messages": MESSAGES}
        resp = await client.post("/v1/chat/completions", json=body)
        await wait_until(lambda: frontend.states == {})
    (msg,) = backend.tokenized()  # what crossed into the tokenizer worker
    # the route's message, stamped on its way out with who sent it (the client's address)
    routed = await message_of_the_route(parse(stream=stream, max_tokens=128), msg.uid)
    assert msg.client.startswith("address ")
    assert msg == msgspec.structs.replace(routed, client=msg.client)
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.text.endswith("data: [DONE]\n\n")
    else:
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["choices"][0]["message"]["content"] == "KV Cache"


async def test_minisgl_refuses_fields_that_would_go_nowhere():
    frontend, backend = make_frontend()
    async with app_client(frontend) as client:
        both = await client.post(
            "/v1/chat/completions", json=chat_body(max_tokens=8, max_completion_tokens=8)
        )
        unknown = await client.post("/v1/chat/completions", json=chat_body(tools=[]))
    assert both.status_code == 400 and both.json()["error"]["param"] == "max_completion_tokens"
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools"
    assert backend.tokenized() == []  # refused before anything was sent
