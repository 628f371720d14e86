"""The Responses API's translation layer without a server: `input` items become the chat
messages they stand for, what cannot be served is refused naming the field, and chat output
becomes Responses events and a response object that the official `openai` client's types
(and its own stream accumulator) accept, in OpenAI's order with sequence numbers."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response
from pydantic import ValidationError

from minisgl.message import ErrorInfo, ErrorKind
from minisgl.parsers import OutputParsers
from minisgl.server.buffer import ChoiceOutput, Output
from minisgl.server.chat import ChatCompletionRequest
from minisgl.server.protocol import ParamError
from minisgl.server.responses import ResponsesFormat, ResponsesRequest, chat_messages
from minisgl.templates import TOOL_CALL_END, TOOL_CALL_START
from minisgl.testing.sse import response_events

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}

HERMES = OutputParsers.chosen("hermes", None)  # the server's default tool-call format


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def refused(**fields) -> ParamError:
    with pytest.raises(ValidationError) as info:
        request(**fields)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ParamError)
    return cause


# ---------------------------------------------------------------- input -> chat
def test_items_become_the_chat_conversation_they_stand_for():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_1", "status": "completed", "namespace": None, "caller": None},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]  # fmt: skip
    messages = chat_messages("Answer in French.", items)
    assert messages == [
        {"role": "system", "content": "Answer in French."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain", "name": "get_weather"},
    ]  # fmt: skip
    chat = request(input=items, tools=[WEATHER]).chat  # the chat path accepts all of it
    assert [m.role for m in chat.messages] == ["developer", "user", "assistant", "tool", "tool"]


def test_fields_map_onto_the_chat_request():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    chat = request(
        instructions="sys", max_output_tokens=7, temperature=0.5, top_p=0.9, text={"format": fmt}
    ).chat
    params = chat.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p) == (7, 0.5, 0.9)
    # (as every response_format schema: keys it does not list are forbidden)
    assert json.loads(params.json_schema) == {**schema, "additionalProperties": False}
    named = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}).chat
    assert named.tool_calling().choice == "get_weather"
    assert request(tools=[WEATHER], parallel_tool_calls=False).chat.tool_calling().parallel is False


def test_the_chat_paths_sampling_extensions_mean_the_same_here():
    """What guidellm and other load generators send to every endpoint (`ignore_eos`, `stop:
    null`, ...) reaches the sampling parameters as it does through chat."""
    peers = dict(
        ignore_eos=True, top_k=5, min_tokens=2, repetition_penalty=1.1, seed=7,
        stop=["\n\n"], stop_token_ids=[3], presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias={"9": -100}, cache_salt="s",
    )  # fmt: skip
    params = request(max_output_tokens=8, **peers).chat.sampling_params()
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **peers}
    )
    assert params == chat.sampling_params()
    assert (params.ignore_eos, params.top_k, params.seed, params.stop) == (True, 5, 7, ["\n\n"])
    defaults = request(stop=None, ignore_eos=None, top_k=None, seed=None).chat.sampling_params()
    assert defaults == request().chat.sampling_params()
    assert not defaults.ignore_eos and defaults.top_k == -1


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"top_k": -2}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"),
     ({"logit_bias": {"x": 1}}, "logit_bias"), ({"min_tokens": 9, "max_output_tokens": 4}, "min_tokens")],
)  # fmt: skip
def test_a_sampling_extension_out_of_bounds_is_refused_as_chat_refuses_it(fields, param):
    assert refused(**fields).param == param


def test_what_the_chat_path_refuses_is_refused_here():
    with pytest.raises(ValidationError) as info:
        request(min_p=0.1)
    assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_fields_that_change_nothing_are_accepted_and_null_is_the_default():
    request(
        store=True, metadata={"k": "v"}, user="u", service_tier="auto", truncation="disabled",
        parallel_tool_calls=True, reasoning={"effort": "low", "summary": None}, include=[],
        prompt_cache_key="p", safety_identifier="s", stream_options={"include_obfuscation": False},
        max_tool_calls=3, text={"verbosity": "low"}, temperature=None, top_p=None,
        max_output_tokens=None, previous_response_id=None, tool_choice=None, tools=None,
        background=False, top_logprobs=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"truncation": "auto"}, "truncation", "never drops"),
        ({"include": ["nonsense"]}, "include", "nonsense"),
        ({"input": []}, "input", "empty"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                     {"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.1",
            "input_image parts are not supported by this text-only model",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0", "keeps no responses"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type", "web_search_call"),
        ({"input": [{"role": "user", "content": "a", "colour": 1}]}, "input.0.colour", "colour"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments", "arguments"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "name"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_the_field(fields, param, words):
    cause = refused(**fields)
    assert cause.param == param and words in str(cause), (cause.param, str(cause))


def test_unknown_fields_and_other_tools_are_refused():
    with pytest.raises(ValidationError) as info:
        request(frobnicate=1)
    assert info.value.errors()[0]["type"] == "extra_forbidden"
    with pytest.raises(ValidationError):
        request(tools=[{"type": "web_search"}])


# ---------------------------------------------------------------- chat output -> events
def _outputs(pieces: list[str], finish: str, error: ErrorInfo | None = None) -> list[Output]:
    outs = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        reason = finish if last and error is None else None
        choice = ChoiceOutput(0, piece, reason, [])
        outs.append(Output([choice], 5, i + 1, last, error if last else None))
    return outs


def _stream(fmt: ResponsesFormat, outputs: list[Output]) -> list:
    raw = b"".join(fmt.chunks(o) for o in outputs) + fmt.closing(outputs[-1], True)
    return response_events(raw)


def _accumulate(events, tools=()) -> Response | None:
    state = ResponseStreamState(input_tools=list(tools), text_format=openai.omit)
    for event in events:
        state.handle_event(event)
    return state._completed_response


def test_text_streams_in_openais_event_order_and_the_whole_answer_agrees():
    req = request(max_output_tokens=3)
    events = _stream(ResponsesFormat("m", req, None), _outputs(["Hel", "lo", "!"], "stop"))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hello!"
    assert final.usage.input_tokens == 5 and final.usage.output_tokens == 3
    assert _accumulate(events).output_text == "Hello!"  # the client's own accumulator
    whole = ResponsesFormat("m", req, None).body(["Hello!"], ["stop"], None, 5, 3)
    body = Response.model_validate(whole, strict=True)
    assert body.output_text == "Hello!" and body.status == "completed"
    assert body.output[0].model_dump() == final.output[0].model_dump() | {"id": body.output[0].id}


def test_max_output_tokens_reached_is_an_incomplete_response():
    events = _stream(ResponsesFormat("m", request(), None), _outputs(["a", "b"], "length"))
    assert events[-1].type == "response.incomplete"
    response = events[-1].response
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_tool_calls_stream_as_function_call_items():
    req = request(tools=[WEATHER])
    chat = req.chat
    call = f'{TOOL_CALL_START}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{TOOL_CALL_END}'
    fmt = ResponsesFormat("m", req, HERMES.tool_calls(chat.tool_calling()))
    events = _stream(fmt, _outputs(["Sure.\n", call[:20], call[20:]], "stop"))
    types = [e.type for e in events]
    assert types[-6:] == [
        "response.output_item.done",  # the message "Sure." closes before the call
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = events[-1].response
    message, function_call = final.output
    assert message.content[0].text == "Sure."
    assert function_call.name == "get_weather" and json.loads(function_call.arguments) == {
        "city": "Paris"
    }
    assert function_call.call_id.startswith("call_")
    assert _accumulate(events, [WEATHER]).output[1].arguments == function_call.arguments
    whole = Response.model_validate(
        ResponsesFormat("m", req, HERMES.tool_calls(chat.tool_calling())).body(
            ["Sure.\n" + call], ["stop"], None, 5, 3
        ),
        strict=True,
    )
    assert [o.type for o in whole.output] == ["message", "function_call"]


def test_an_error_after_the_stream_began_is_a_failed_response():
    error = ErrorInfo(ErrorKind.SLOW_CLIENT, "too slow")
    events = _stream(ResponsesFormat("m", request(), None), _outputs(["a", "b"], "stop", error))
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == "too slow"


def test_an_error_before_the_first_byte_names_the_field_as_the_responses_api_does():
    fmt = ResponsesFormat("m", request(), None)
    fmt.renamed = {"max_tokens": "max_completion_tokens"}  # as chat_job sets it: the chat name
    too_many = ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "no room", "max_tokens")
    answer = fmt.error(too_many)
    assert (answer.status, answer.param, answer.code) == (
        400, "max_output_tokens", "context_length_exceeded"
    )  # fmt: skip
    assert fmt.error(ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "long")).param == "input"
    assert fmt.error(ErrorInfo(ErrorKind.INVALID_TOKEN_ID, "x", "logit_bias")).param == "logit_bias"


def test_nothing_said_is_one_empty_message():
    whole = ResponsesFormat("m", request(), None).body([""], ["stop"], None, 5, 1)
    assert Response.model_validate(whole, strict=True).output_text == ""
    events = _stream(ResponsesFormat("m", request(), None), _outputs([""], "stop"))
    assert "response.output_item.done" in [e.type for e in events]
