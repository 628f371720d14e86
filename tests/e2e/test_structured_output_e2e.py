"""`response_format` over the real server (tiny Llama) with the official client: every
answer under `json_schema` or `json_object` parses and validates, greedy or sampled,
streamed or not, with stop strings, min_tokens and penalties, on both endpoints; a schema
that cannot be compiled is a 400 naming `response_format` before the scheduler sees it,
streamed or not; /debug/lifecycle (which counts grammar matchers) is back at zero after
each test."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import PROTOCOL_SERVER

pytestmark = pytest.mark.server(PROTOCOL_SERVER)

SCHEMA = {
    "type": "object",
    "properties": {
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "side": {"enum": ["left", "right"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["digit", "side"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Pick a digit and a side."}]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_answers_follow_the_schema(server, client, stream, temperature):
    params = dict(
        model=server.model_name, messages=MESSAGES, max_tokens=80, temperature=temperature,
        n=2, seed=3, response_format=FORMAT,
    )  # fmt: skip
    if stream:
        texts, finish = ["", ""], [None, None]
        for chunk in client.chat.completions.create(**params, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
    else:
        resp = client.chat.completions.create(**params)
        texts = [c.message.content for c in resp.choices]
        finish = [c.finish_reason for c in resp.choices]
    for text, reason in zip(texts, finish):
        assert reason == "stop", (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_stop_strings_and_penalties_leave_the_answer_valid(server, client, stream):
    params = dict(
        model=server.model_name, messages=MESSAGES, max_tokens=80, temperature=1.0, n=2,
        seed=4, response_format=FORMAT, stop=['"', ":", "}"], presence_penalty=2.0,
        frequency_penalty=2.0, extra_body={"min_tokens": 40, "repetition_penalty": 2.0},
    )  # fmt: skip
    if stream:
        texts = ["", ""]
        for chunk in client.chat.completions.create(**params, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**params).choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_json_object(server):
    # the client's completions API has no response_format argument: the raw request
    body = {
        "model": server.model_name, "prompt": "An object:", "max_tokens": 80, "seed": 1,
        "response_format": {"type": "json_object"},
    }  # fmt: skip
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:  # an object may nest deeper than max_tokens allows: then it is cut, as OpenAI says
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_schema_that_cannot_compile_is_a_400_naming_response_format(server, client, stream):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=5, response_format=bad,
            stream=stream,
        )  # fmt: skip
    error = info.value.body
    assert error["param"] == "response_format" and "schema" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_disconnect_mid_way_leaves_nothing_behind(server, stream):
    # a long constrained answer (an array of 400 to 500 digits: seconds of decoding),
    # dropped after its start
    schema = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 400, "maxItems": 500}
    body = {
        "model": server.model_name, "messages": MESSAGES, "max_tokens": 1500, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }  # fmt: skip
    url = server.base_url + "/v1/chat/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_raw())  # the first chunk, then the client goes away
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.3)
    assert server.lifecycle()["scheduler"]["grammar_matchers"] <= 1
    server.wait_zero(5.0)
