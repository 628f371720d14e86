"""Q2：对照 v1_completions，追踪 messages、max_tokens 和 stream 分别进入了哪个处理分支。

答（minisgl 的 /v1/chat/completions，`api_server.v1_chat_completions`）：
- 请求体先由 `ChatCompletionRequest`（protocol.py）解析和校验；
- `messages` 经 `ChatMessage.as_template_input()` 变成 `{"role", "content"}` 字典列表，放进
  `TokenizeMsg.messages`，由 tokenizer worker 套用聊天模板（`text` 为空）；
- `max_tokens`（或新名字 `max_completion_tokens`，两个只能给一个）由 `sampling_params()`
  放进 `SamplingParams.max_tokens`，随 TokenizeMsg 一起送往后端；stop、n 等参数也一样进去；
- `stream` 不进后端，只在前台选响应对象：`StreamResponse`（SSE）或 `FullResponse`（一个 JSON）。
"""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from quiz_helpers import MODEL, answer, app_client, app_for, chat_body

from minisgl.server.protocol import ChatCompletionRequest
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
TEMPLATE_INPUT = [
    {"role": "system", "content": "用中文回答。"},  # "developer" is the template's "system"
    {"role": "user", "content": "什么是 KV Cache？"},  # text parts joined
]


def parse(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, **fields})


def test_max_tokens_and_max_completion_tokens_both_become_sampling_params_max_tokens():
    assert parse(max_tokens=128).sampling_params().max_tokens == 128
    assert parse(max_completion_tokens=64).sampling_params().max_tokens == 64
    assert parse().sampling_params().max_tokens is None  # no limit but the context
    # the parameters the reference accepted but dropped reach the backend here
    params = parse(stop=["\n\n"], n=2, seed=7).sampling_params()
    assert (params.stop, params.n, params.seed) == (["\n\n"], 2, 7)


def test_messages_become_the_chat_template_input():
    req = parse()
    assert [m.as_template_input() for m in req.messages] == TEMPLATE_INPUT


async def test_stream_is_not_sent_to_the_backend_it_picks_the_response_object():
    frontend, _ = make_frontend()
    app = app_for(frontend)
    app.state.frontend = frontend  # what the lifespan does; the route only builds a response
    (route,) = [
        r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/chat/completions"
    ]
    streamed = await route.endpoint(parse(stream=True, max_tokens=128))
    full = await route.endpoint(parse(stream=False, max_tokens=128))
    assert type(streamed) is StreamResponse and type(full) is FullResponse
    # building the response sent nothing: the request starts when Starlette calls it
    assert frontend.states == {}
    # the message each one would send differs in nothing: stream stays in the frontend
    msg_streamed, msg_full = streamed.job.make_msgs[0](7), full.job.make_msgs[0](7)
    assert msg_streamed == msg_full
    assert msg_full.messages == TEMPLATE_INPUT and msg_full.text is None
    assert msg_full.sampling_params.max_tokens == 128


@pytest.mark.parametrize("stream", [False, True])
async def test_through_the_real_app_the_backend_receives_messages_and_max_tokens(stream):
    frontend, backend = make_frontend()
    answer(backend, ["KV", " Cache"])
    async with app_client(frontend) as client:
        body = {**chat_body(stream, max_tokens=128), "messages": MESSAGES}
        resp = await client.post("/v1/chat/completions", json=body)
        await wait_until(lambda: frontend.states == {})
    (msg,) = backend.tokenized()  # what crossed into the tokenizer worker
    assert msg.messages == TEMPLATE_INPUT and msg.sampling_params.max_tokens == 128
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.text.endswith("data: [DONE]\n\n")
    else:
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["choices"][0]["message"]["content"] == "KV Cache"


async def test_fields_that_go_nowhere_are_refused_not_ignored():
    frontend, backend = make_frontend()
    async with app_client(frontend) as client:
        both = await client.post(
            "/v1/chat/completions", json=chat_body(max_tokens=8, max_completion_tokens=8)
        )
        unknown = await client.post("/v1/chat/completions", json=chat_body(tools=[]))
    assert both.status_code == 400 and both.json()["error"]["param"] == "max_completion_tokens"
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools"
    assert backend.tokenized() == []  # refused before anything was sent
