"""--reasoning-parser over the real server, with a tiny model that says a known script
(tests/scripted_model.py): `<think>` reasoning, an answer, a `<tool_call>` and the end.

- qwen3 (the model opens the block itself): the think block comes back as
  `message.reasoning` and streams as `delta.reasoning`, each also under vLLM's older name
  `reasoning_content` (clients of either generation read it), never in content;
  usage counts its tokens; the tool call after the reasoning is parsed, streamed or not;
  `chat_template_kwargs: {"enable_thinking": false}` and `reasoning_effort: "none"` reach
  the template, which then closes the block in the prompt: no reasoning comes back.
- deepseek-r1 (the template opens the block in the prompt, the output only closes it): the
  tokenizer worker tells the API server, so the output's start is reasoning.
Every test ends with /debug/lifecycle at zero (the `server` fixture)."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import ServerSpec
from openai.types.chat import ChatCompletionChunk
from scripted_model import ANSWER, ANSWER_TOKENS, ARGUMENTS, REASONING, make_scripted_checkpoint

WEATHER = [{"role": "user", "content": "weather?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="session")
def qwen3_scripted_dir(tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def r1_scripted_dir(tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted-r1"), "deepseek-r1")


QWEN3 = pytest.mark.server(ServerSpec("qwen3_scripted_dir", ("--reasoning-parser", "qwen3")))
R1 = pytest.mark.server(ServerSpec("r1_scripted_dir", ("--reasoning-parser", "deepseek-r1")))


def ask(client, server, stream: bool, **params):
    """(reasoning, content, [(name, arguments)], finish_reason, usage) of one answer."""
    params = {"model": server.model_name, "messages": WEATHER, "temperature": 0, **params}
    if not stream:
        resp = client.chat.completions.create(**params)
        choice = resp.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        reasoning = choice.message.model_extra["reasoning"]
        assert choice.message.model_extra["reasoning_content"] == reasoning
        return reasoning, choice.message.content, calls, choice.finish_reason, resp.usage
    chunks = list(
        client.chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}
        )
    )
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.to_dict())
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")  # both names
            reasoning += extra.get("reasoning") or ""
            content += delta.content or ""
            assert "think>" not in (delta.content or "") and "<tool_call>" not in content
            for call in delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                name += call.function.name or "" if call.function else ""
                arguments += call.function.arguments or "" if call.function else ""
                calls[call.index] = (name, arguments)
            finish = choice.finish_reason or finish
    usage = chunks[-1].usage
    return reasoning or None, content or None, list(calls.values()), finish, usage


@QWEN3
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_the_think_block_is_reasoning_content_never_content(server, client, stream):
    reasoning, content, calls, finish, usage = ask(client, server, stream, max_tokens=ANSWER_TOKENS)
    # (without tools the answer is as written; before a call its line break is markup's)
    assert (reasoning, content, calls, finish) == (REASONING, ANSWER + "\n", [], "length")
    assert usage.completion_tokens == ANSWER_TOKENS  # the reasoning's tokens count


@QWEN3
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_tool_call_after_the_reasoning_is_parsed(server, client, stream):
    reasoning, content, calls, finish, _ = ask(client, server, stream, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "tool_calls")
    assert calls == [("get_weather", ARGUMENTS)] and json.loads(calls[0][1]) == {"city": "Paris"}


@QWEN3
@pytest.mark.parametrize(
    "off",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}],
    ids=["enable_thinking", "reasoning_effort"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_thinking_turned_off_reaches_the_template(server, client, stream, off):
    reasoning, content, _, _, usage = ask(client, server, stream, max_tokens=1, extra_body=off)
    # the prompt closed the block: the output is all answer, as the model wrote it
    assert (reasoning, content) == (None, "\n\n" + ANSWER + "\n")
    _, _, _, _, thinking = ask(client, server, stream, max_tokens=1)
    assert usage.prompt_tokens == thinking.prompt_tokens + 2  # `<think> </think>`


@R1
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_prompt_that_opens_the_block_makes_the_output_start_as_reasoning(server, client, stream):
    reasoning, content, calls, finish, _ = ask(client, server, stream, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "tool_calls")
    assert calls == [("get_weather", ARGUMENTS)]
    cut = ask(client, server, stream, max_tokens=2)  # cut inside the reasoning
    assert cut[:2] == (REASONING, None) and cut[3] == "length"


@QWEN3
def test_an_answer_sent_back_as_the_client_dumps_it_continues_the_conversation(server, client):
    """The official client's message, dumped whole, carries `reasoning` and
    `reasoning_content`: both are accepted as the turn's thinking."""
    first = client.chat.completions.create(
        model=server.model_name, messages=WEATHER, tools=TOOLS, temperature=0
    )
    said = first.choices[0].message.model_dump(exclude_none=True)
    assert said["reasoning"] == said["reasoning_content"] == REASONING
    (call,) = said["tool_calls"]
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
    again = client.chat.completions.create(
        model=server.model_name, messages=[*WEATHER, said, tool], tools=TOOLS, max_tokens=4
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
