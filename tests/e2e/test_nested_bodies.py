"""Deeply nested JSON anywhere in a body is a 400 with the OpenAI error body, never a 500
(the protocol tests' tiny Llama): as the body's own structure, inside a JSON schema or a
tool's parameters, and as the JSON text of an earlier tool call's `arguments` (chat
messages and Responses `function_call` items alike), which the chat template would
otherwise parse and write back out. Moderately nested arguments are still served.
The `server` fixture checks the lifecycle is back at zero after each test."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import PROTOCOL_SERVER, assert_error_body, chat_url

from minisgl.utils.nesting import MAX_JSON_DEPTH

pytestmark = pytest.mark.server(PROTOCOL_SERVER)

DEEP = 100_000  # far past any recursion limit
DEEP_ARRAY = "[" * DEEP + "]" * DEEP
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _chat(server, **extra) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": server.model_name, "messages": messages, "max_tokens": 2, **extra}


def _with_arguments(server, arguments: str) -> dict:
    call = {**TOOL_CALL, "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    return {"model": server.model_name, "messages": messages, "max_tokens": 2}


def _responses_with_arguments(server, arguments: str) -> dict:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
    ]
    return {"model": server.model_name, "input": items, "max_output_tokens": 16}


def _raw(server, path: str, text: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + path, content=text, headers=headers, timeout=60)


def _assert_400(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    return assert_error_body(r.json())


@pytest.mark.parametrize("shape", ["array", "object"])
def test_a_body_nested_past_any_limit_is_a_400(server, shape):
    inner = DEEP_ARRAY if shape == "array" else DEEP_OBJECT
    head = f'{{"model": "{server.model_name}", "prompt": "hi", "input": "hi", '
    text = head + f'"messages": [{{"role": "user", "content": "hi"}}], "metadata": {inner}}}'
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        _assert_400(_raw(server, path, text))


@pytest.mark.parametrize("where", ["chat", "responses"])
@pytest.mark.parametrize("arguments", [DEEP_ARRAY, DEEP_OBJECT], ids=["array", "object"])
def test_tool_call_arguments_nested_past_any_limit_are_a_400(server, where, arguments):
    if where == "chat":
        r = httpx.post(chat_url(server), json=_with_arguments(server, arguments), timeout=60)
    else:
        body = _responses_with_arguments(server, arguments)
        r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    error = _assert_400(r)
    assert f"more than the {MAX_JSON_DEPTH} allowed" in error["message"], error


def _schema_text(depth: int) -> str:
    """A schema `depth` objects deep, as text (past Python's own json encoder's limit)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH // 2, 400])
def test_schemas_nested_past_the_limit_are_a_400(server, depth):
    """A schema level is two levels of JSON (the schema, its `properties`): 32 levels of
    schema are 65 of JSON, past the limit; 400 are within what the body's parser takes."""
    schema = _schema_text(depth)
    response_format = '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}'
    tool = '[{"type": "function", "function": {"name": "f", "parameters": %s}}]'
    text_format = '{"format": {"type": "json_schema", "name": "x", "schema": %s}}'
    responses_tool = '[{"type": "function", "name": "f", "parameters": %s}]'
    head = f'{{"model": "{server.model_name}", "max_tokens": 2, '
    chat = head + '"messages": [{"role": "user", "content": "hi"}], '
    responses = f'{{"model": "{server.model_name}", "input": "hi", '
    bodies = [
        ("/v1/chat/completions", chat + '"response_format": ' + response_format % schema + "}"),
        ("/v1/chat/completions", chat + '"tools": ' + tool % schema + "}"),
        ("/v1/responses", responses + '"text": ' + text_format % schema + "}"),
        ("/v1/responses", responses + '"tools": ' + responses_tool % schema + "}"),
    ]
    for path, text in bodies:
        error = _assert_400(_raw(server, path, text))
        assert f"more than the {MAX_JSON_DEPTH} allowed" in error["message"], error


def test_a_schema_at_the_limit_is_served(server):
    depth = (MAX_JSON_DEPTH - 2) // 2  # the schema's JSON nests 2 * depth + 1 levels
    schema = _schema_text(depth)
    body = f'{{"model": "{server.model_name}", "max_tokens": 2, '
    body += '"messages": [{"role": "user", "content": "hi"}], "response_format": '
    body += f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}}}'
    r = _raw(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]


def test_arguments_nested_a_little_are_served(server):
    arguments = '{"a": ' * 20 + "1" + "}" * 20
    r = httpx.post(chat_url(server), json=_with_arguments(server, arguments), timeout=60)
    assert r.status_code == 200, r.text
    body = _responses_with_arguments(server, arguments)
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
