"""The embedded default model (SmolLM2-135M-Instruct, real weights) behind the real server:
the chapter's request works streamed and not, greedy answers make sense, structured
output follows five kinds of schema (greedy and sampled, streamed or not) and `parse`, and
forced tool calls carry valid arguments, and a tool's result fed back gets an answer."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from e2e_helpers import (
    DEFAULT_MODEL_SERVER,
    SSE_DONE,
    chat_body,
    chat_url,
    chunk_text,
)
from pydantic import BaseModel, Field

from minisgl.testing.sse import sse_chunks

CHAPTER_PROMPT = "什么是 KV Cache？"

pytestmark = pytest.mark.server(DEFAULT_MODEL_SERVER)


def test_chapter_request_non_streaming(server):
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32)
    r = httpx.post(chat_url(server), json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "SmolLM2-135M-Instruct"
    assert out["choices"][0]["message"]["content"].strip()
    assert out["choices"][0]["finish_reason"] in {"stop", "length"}
    assert 1 <= out["usage"]["completion_tokens"] <= 32


def test_chapter_request_streaming(server):
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32, stream=True)
    with httpx.stream("POST", chat_url(server), json=body, timeout=120) as r:
        raw = r.read()
    assert r.status_code == 200 and raw.endswith(SSE_DONE)
    chunks = sse_chunks(raw)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    assert chunk_text(chunks).strip()


def test_chapter_request_greedy_text_is_whole_characters(server):
    """Greedy output, streamed or not, is the same text with no U+FFFD in it: multi-byte
    characters split across tokens are held back until complete."""
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32, temperature=0)
    full = httpx.post(chat_url(server), json=body, timeout=120).json()
    text = full["choices"][0]["message"]["content"]
    with httpx.stream("POST", chat_url(server), json={**body, "stream": True}, timeout=120) as r:
        raw = r.read()
    streamed = chunk_text(sse_chunks(raw))
    assert text.strip() and "\ufffd" not in text
    assert streamed == text


def test_the_default_model_is_served_from_its_own_gguf_blocks(server):
    """`make run` (no flags) computes with the GGUF's quantized weights, not a float copy."""
    assert "weights: gguf" in server.log()


def test_capital_of_france_is_paris_via_the_openai_client(server, client):
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content


# ---------------------------------------------------------------- structured output
# five kinds of schema, every string bounded: a free string could run to max_tokens
STRUCTURED = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
              "minItems": 1, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["celsius", "ratio"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "note": {"type": "string", "maxLength": 10},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_output_follows_the_schema(server, client, kind, temperature, stream):
    schema = STRUCTURED[kind]
    params = dict(
        model=server.model_name,
        messages=[{"role": "user", "content": f"Answer in JSON: an example of {kind}."}],
        max_tokens=160,
        temperature=temperature,
        seed=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": kind, "schema": schema, "strict": True},
        },
    )
    if stream:
        chunks = list(client.chat.completions.create(**params, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
    else:
        choice = client.chat.completions.create(**params).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", (text, finish)
    jsonschema.validate(json.loads(text), schema)


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain"]
    population_millions: int = Field(ge=0, le=40)


def test_parse_with_a_pydantic_model(server, client):
    completion = client.beta.chat.completions.parse(
        model=server.model_name,
        messages=[{"role": "user", "content": "Describe the capital of France."}],
        max_tokens=120,
        temperature=0,
        response_format=City,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and completion.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- tool calls
# the embedded model's template shows tools in the Hermes format (smollm2-tools)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
        },
    },
}
TOOL_PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}  # fmt: skip
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_carry_valid_arguments(server, client, choice, temperature, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = dict(
        model=server.model_name, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=named if choice == "named" else "required", max_tokens=120,
        temperature=temperature, seed=5,
    )  # fmt: skip
    if stream:
        with client.chat.completions.stream(**params) as events:
            choice_out = events.get_final_completion().choices[0]
    else:
        choice_out = client.chat.completions.create(**params).choices[0]
    assert choice_out.finish_reason == ("stop" if choice == "named" else "tool_calls")
    calls = choice_out.message.tool_calls
    assert calls and not choice_out.message.content
    if choice == "named":
        assert [c.function.name for c in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(
            json.loads(call.function.arguments), TOOL_PARAMETERS[call.function.name]
        )


def test_required_without_parallel_calls_gives_one_whole_call(server, client):
    """The chapter's advice for a small model (chapters/beyond/openai.md): with parallel calls
    off, the grammar ends the answer after the first call, so each sample is one whole,
    valid call, never the start of a second it cannot finish."""
    out = client.chat.completions.create(
        model=server.model_name, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0,
        seed=5, n=3,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        jsonschema.validate(
            json.loads(call.function.arguments), TOOL_PARAMETERS[call.function.name]
        )


def test_a_tool_result_fed_back_gets_an_answer(server, client):
    tools = [WEATHER_TOOL]
    first = client.chat.completions.create(
        model=server.model_name, messages=WEATHER_QUESTION, tools=tools,
        tool_choice="required", max_tokens=120, temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    result = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
    history = WEATHER_QUESTION + [
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = client.chat.completions.create(
        model=server.model_name, messages=history, tools=tools, max_tokens=48, temperature=0
    ).choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and answer.message.content.strip()
    # the model read the result: it says what the tool said
    assert "21" in answer.message.content or "sunny" in answer.message.content.lower()
