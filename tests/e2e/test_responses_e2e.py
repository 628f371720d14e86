"""`POST /v1/responses` over the real server (the protocol tests' tiny Llama), through the
official `openai` client: a response is the chat completion its translation stands for
(greedy, the same text), whole or streamed; the stream is OpenAI's event sequence, each
event valid as the client's type and numbered, ending with the whole response and no
`[DONE]`, and `responses.stream` assembles it; `text.format` json_schema is followed;
fields that change nothing are accepted; the chat path's sampling extensions mean the same
here (guidellm's request, with `ignore_eos` and `stop: null`, twelve times, four at once:
no error, exactly its tokens; a seed repeats a sampled answer); what cannot be served is an
OpenAI error with a real status before the first byte, for `stream: true` too; a client
that leaves mid-stream leaves nothing behind (the `server` fixture checks the lifecycle
after each)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import ERROR_KEYS, PROTOCOL_SERVER
from openai.types.responses import Response

from minisgl.testing.sse import response_events

pytestmark = pytest.mark.server(PROTOCOL_SERVER)


def responses_url(server) -> str:
    return server.base_url + "/v1/responses"


def raw_events(server, body: dict) -> list:
    """The stream's events, each checked against its `event:` line and numbered in order."""
    with httpx.stream(
        "POST", responses_url(server), json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert "[DONE]" not in raw
    return response_events(raw)


def test_a_response_is_the_chat_completion_it_stands_for(server, client):
    response = client.responses.with_raw_response.create(
        model=server.model_name, instructions="Be brief.", input="The capital of France is",
        max_output_tokens=12, temperature=0,
    )  # fmt: skip
    body = Response.model_validate(response.http_response.json(), strict=True)
    assert body.object == "response" and body.id.startswith("resp_")
    chat = client.chat.completions.create(
        model=server.model_name, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "The capital of France is"}],
    )  # fmt: skip
    assert body.output_text == chat.choices[0].message.content
    assert body.usage.input_tokens == chat.usage.prompt_tokens
    assert body.usage.output_tokens == chat.usage.completion_tokens
    assert body.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    if body.status == "incomplete":
        assert body.incomplete_details.reason == "max_output_tokens"


def test_message_items_are_the_conversation(server, client):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of Italy?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome.", "annotations": []}]},
        {"role": "user", "content": "And of France?"},
    ]  # fmt: skip
    body = client.responses.create(
        model=server.model_name, input=items, max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model=server.model_name, max_tokens=10, temperature=0,
        messages=[{"role": "developer", "content": "Answer in one word."},
                  {"role": "user", "content": "Capital of Italy?"},
                  {"role": "assistant", "content": "Rome."},
                  {"role": "user", "content": "And of France?"}],
    )  # fmt: skip
    assert body.output_text == chat.choices[0].message.content


def test_streaming_is_openais_event_sequence_and_agrees_with_the_whole_answer(server, client):
    body = {"model": server.model_name, "input": "Streaming responses send", "max_output_tokens": 16,
            "temperature": 0}  # fmt: skip
    events = raw_events(server, body)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(**body)
    assert streamed == final.output_text == events[-4].text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_clients_stream_helper_assembles_the_response(server, client):
    with client.responses.stream(
        model=server.model_name, input="The capital of France is", max_output_tokens=2000,
        temperature=0,
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)


def test_a_json_schema_text_format_is_followed(server, client):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "trip", "schema": schema, "strict": True}}
    body = client.responses.create(
        model=server.model_name, input="A trip?", text=text, temperature=1.0, max_output_tokens=200
    )
    assert body.status == "completed"
    jsonschema.validate(json.loads(body.output_text), schema)
    assert body.text.format.type == "json_schema"


def test_fields_that_change_nothing_are_accepted(server, client):
    body = client.responses.create(
        model=server.model_name, input="hi", max_output_tokens=4, temperature=0, store=True,
        metadata={"run": "1"}, user="u-1", service_tier="auto", truncation="disabled",
        parallel_tool_calls=True, reasoning={"effort": "low"}, include=[], top_p=None,
        prompt_cache_key="k", safety_identifier="s",
    )  # fmt: skip
    assert body.metadata == {"run": "1"} and body.output


def _guidellm_body(server, i: int, tokens: int) -> dict:
    """The body guidellm's Responses mode sends (request_format=/v1/responses) for synthetic
    text with a fixed output length."""
    text = f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * 3
    return {
        "model": server.model_name, "stream": True, "max_output_tokens": tokens, "stop": None,
        "ignore_eos": True, "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
    }  # fmt: skip


def test_guidellms_responses_requests_have_no_errors(server):
    tokens = 16

    def run(i: int) -> Response:
        events = raw_events(server, _guidellm_body(server, i, tokens))
        assert events[-1].type == "response.incomplete", events[-1].type  # max_output_tokens
        return events[-1].response

    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(run, range(12)))
    assert [r.usage.output_tokens for r in done] == [tokens] * 12  # ignore_eos held to the end
    assert all(r.incomplete_details.reason == "max_output_tokens" for r in done)


def test_the_chat_paths_sampling_extensions_mean_the_same_here(server, client):
    peers = dict(top_k=5, min_tokens=3, repetition_penalty=1.2, seed=11, frequency_penalty=0.5,
                 ignore_eos=True)  # fmt: skip
    ask = dict(model=server.model_name, input="The capital of France is", max_output_tokens=8)
    first = client.responses.create(**ask, temperature=1.0, extra_body=peers)
    again = client.responses.create(**ask, temperature=1.0, extra_body=peers)
    assert first.output_text == again.output_text and first.usage.output_tokens == 8
    chat = client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": ask["input"]}],
        max_tokens=8, temperature=1.0, **{k: v for k, v in peers.items() if k in ("seed", "frequency_penalty")},
        extra_body={k: v for k, v in peers.items() if k not in ("seed", "frequency_penalty")},
    )  # fmt: skip
    assert chat.choices[0].message.content == first.output_text  # the same request, as chat


def _assert_error(r: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_what_cannot_be_served_is_an_error_with_a_real_status(server, stream):
    def post(**fields):
        body = {"model": server.model_name, "input": "hi", "stream": stream, **fields}
        return httpx.post(responses_url(server), json=body, timeout=60)

    _assert_error(post(previous_response_id="resp_1"), 400, "previous_response_id", "keeps no")
    _assert_error(post(frobnicate=1), 400, "frobnicate", "frobnicate")
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    _assert_error(
        post(input=[{"role": "user", "content": [image]}]), 400, "input.0.content.0", "input_image"
    )
    _assert_error(post(input="x " * 3000), 400, "input", "context")  # known before any byte
    _assert_error(post(top_k=-5), 400, "top_k", "top_k")  # the chat path's bounds
    _assert_error(post(min_p=0.1), 400, "min_p", "min_p")  # what chat refuses too
    _assert_error(post(max_output_tokens=5000), 400, "max_output_tokens", "context is 2048")
    _assert_error(post(model="other"), 404, "model", "other")


def test_the_official_client_raises_its_error_types(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=server.model_name, input="hi", previous_response_id="resp_x")
    assert info.value.param == "previous_response_id"


def test_a_client_leaving_mid_stream_leaves_nothing_behind(server):
    body = {"model": server.model_name, "input": "Tell a long story", "max_output_tokens": 1500,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", responses_url(server), json=body, timeout=60) as r:
        lines = r.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
    # the `server` fixture waits for /debug/lifecycle to be back at zero
