"""Tool calling over the real server with the official client, on the tiny Llama given
the shipped tool template (`--chat-template smollm2-tools`): a random model's forced calls
(`tool_choice` "required" or a named function) always name a tool of the request and carry
arguments valid against its parameters, greedy or sampled, streamed or not, with n > 1;
`parallel_tool_calls: false` gives one call; a conversation that sends a call and its
result back is served; a tool whose parameters are no schema is a 400 naming `tools`; a
client that leaves during a call leaves nothing behind. (That a model whose template has no
tools is refused is in test_protocol_params.py; the embedded model's own calls are in
test_default_model_server.py.)"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import ServerSpec

pytestmark = pytest.mark.server(
    ServerSpec(
        "long_context_dir",
        ("--max-seq-len", "2048", "--page-size", "4", "--chat-template", "smollm2-tools"),
    )
)

# bounded arguments: a random tiny model cannot ramble inside them (no free strings)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour"],
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Rome for three days?"}]
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


def ask(client, server, stream: bool, **params):
    """(finish_reason, content, [(name, arguments)]) per choice, streamed or not."""
    params = {"model": server.model_name, "messages": MESSAGES, "max_tokens": 200, **params}
    if not stream:
        resp = client.chat.completions.create(**params)
        return [
            (
                c.finish_reason,
                c.message.content,
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            )
            for c in resp.choices
        ]
    with client.chat.completions.stream(**params) as events:  # the client's own assembly
        final = events.get_final_completion()
    return [
        (
            c.finish_reason,
            c.message.content,
            [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
        )
        for c in final.choices
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_name_a_tool_and_carry_valid_arguments(
    server, client, choice, temperature, stream
):
    tool_choice = NAMED if choice == "named" else "required"
    answers = ask(
        client, server, stream, tools=TOOLS, tool_choice=tool_choice, temperature=temperature,
        n=2, seed=5,
    )  # fmt: skip
    assert len(answers) == 2
    for finish, content, calls in answers:
        # OpenAI ends a named function's call with "stop", a required one with "tool_calls"
        assert finish == ("stop" if choice == "named" else "tool_calls"), (finish, content)
        assert not content and calls
        if choice == "named":
            assert len(calls) == 1 and calls[0][0] == "set_alarm"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_without_parallel_calls_there_is_one(server, client):
    for seed in range(3):
        answers = ask(
            client, server, False, tools=TOOLS, tool_choice="required", temperature=1.0,
            parallel_tool_calls=False, seed=seed,
        )  # fmt: skip
        assert len(answers[0][2]) == 1


def test_a_call_and_its_result_sent_back_are_served(server, client):
    first = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=200, seed=1,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        first.choices[0].message,  # sent back as the client parsed it
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True})},
    ]
    resp = client.chat.completions.create(
        model=server.model_name, messages=history, tools=TOOLS, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].finish_reason in ("length", "tool_calls")
    # the call and its result were rendered into the prompt, after the same first turn
    assert resp.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_whose_parameters_are_no_schema_is_a_400_naming_tools(
    server, client, choice, stream
):
    bad = [
        TOOLS[0],
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=5, tools=bad,
            tool_choice=choice, stream=stream,
        )  # fmt: skip
    error = info.value.body
    assert error["param"] == "tools" and "tools[1] (f)" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_disconnect_during_a_call_leaves_nothing_behind(server, stream):
    # a call whose arguments hold 400 to 500 numbers: seconds of decoding
    long = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 400, "maxItems": 500}},
        "required": ["xs"],
    }  # fmt: skip
    body = {
        "model": server.model_name, "messages": MESSAGES, "max_tokens": 1500, "stream": stream,
        "tools": [{"type": "function", "function": {"name": "many", "parameters": long}}],
        "tool_choice": "required",
    }  # fmt: skip
    url = server.base_url + "/v1/chat/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_raw())  # the first chunk (the role), then the client goes away
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.3)
    assert server.lifecycle()["scheduler"]["grammar_matchers"] <= 1
    server.wait_zero(5.0)
