"""Tool calling without a server: the `<tool_call>` parser (streamed text split anywhere
reads like the whole; a block that is not a call stays content, nothing is lost), the
grammar that forces calls (it accepts the calls it should and nothing else, and a tiny
model sampling under it always produces calls whose arguments validate), the request
checks, the chat format's streamed `delta.tool_calls` against the non-streamed message,
and the chat templates' tool support."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field, ValidationError
from tiny import make_tokenizer

from minisgl import LLM, SamplingParams
from minisgl.parsers import OutputParsers
from minisgl.parsers.hermes import MAX_PARALLEL_CALLS, ToolCalling, ToolCallParser
from minisgl.server.buffer import ChoiceOutput, Output
from minisgl.server.chat import ChatCompletionRequest, ChatFormat
from minisgl.templates import chat_template_text
from minisgl.testing.sse import sse_payloads
from minisgl.tokenizer.tokenize import ToolsUnsupported, build_prompt_ids, load_tokenizer
from minisgl.utils.jsonschema import closed_schema

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
NAMES = {"get_weather", "get_time"}


def block(name: str, arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


TWO_CALLS = (
    "Let me look.\n"
    + block("get_weather", {"city": "Paris"})
    + "\n"
    + block("get_time", {"tz": "CET"})
    + "\n"
)


def parse_in_pieces(
    text: str,
    cuts: list[int],
    parallel: bool = True,
    truncated: bool = False,
    forced: bool = False,
    names: set[str] = NAMES,
):
    """(content, calls) of `text` fed in pieces cut at `cuts`; the calls as the deltas
    add them up, checked against the parser's own whole calls."""
    parser = ToolCallParser(names, parallel, forced)
    content, deltas = "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        piece, new = parser.feed(text[a:b])
        content += piece
        deltas += new
    rest, new = parser.close(truncated)
    calls = assembled(deltas + new)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == calls
    return content + rest, parser.calls


def assembled(deltas) -> list[tuple[str, str]]:
    """Streamed tool-call deltas put together as a client does: (name, arguments)."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


def named(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ---------------------------------------------------------------- the parser
def test_text_split_at_any_point_parses_like_the_whole():
    whole = parse_in_pieces(TWO_CALLS, [])
    assert whole[0] == "Let me look."
    assert named(whole[1]) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    for cut in range(1, len(TWO_CALLS)):
        content, calls = parse_in_pieces(TWO_CALLS, [cut])
        assert (content, named(calls)) == (whole[0], named(whole[1])), cut
    content, calls = parse_in_pieces(TWO_CALLS, list(range(1, len(TWO_CALLS))))  # per char
    assert (content, named(calls)) == (whole[0], named(whole[1]))


def test_a_call_is_named_once_its_head_is_read_and_its_arguments_stream_as_decoded():
    parser = ToolCallParser(NAMES)
    head_end = TWO_CALLS.index('"arguments": ') + len('"arguments": ')
    content, deltas = parser.feed(TWO_CALLS[:head_end])
    assert content == "Let me look." and deltas == []  # the arguments have not begun
    _, (first,) = parser.feed(TWO_CALLS[head_end : head_end + 1])  # their "{"
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": "{"}
    pieces = []
    for c in TWO_CALLS[head_end + 1 : TWO_CALLS.index("</tool_call>")]:  # char by char
        _, deltas = parser.feed(c)
        pieces += [(d["index"], d["function"]["arguments"]) for d in deltas]
    assert all(set(d) == {"index", "function"} for d in deltas)  # no id or name again
    assert "".join(p for _, p in pieces) == '"city": "Paris"}' and {i for i, _ in pieces} == {0}
    _, deltas = parser.feed(TWO_CALLS[TWO_CALLS.index("</tool_call>") :])
    assert [(d["index"], d["function"]) for d in deltas] == [
        (1, {"name": "get_time", "arguments": '{"tz": "CET"}'})
    ]
    ids = [c["id"] for c in parser.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_markup_inside_argument_strings_is_data():
    text = block("get_weather", {"city": "a </tool_call> <tool_call> b"}) + " after"
    for cuts in ([], list(range(1, len(text)))):
        content, calls = parse_in_pieces(text, cuts)
        assert content == " after"
        assert named(calls) == [("get_weather", {"city": "a </tool_call> <tool_call> b"})]


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        block("launch_rocket", {}),  # no such tool
        block("get_time", "CET"),  # arguments that are not an object
        "<tool_call>\n{not json",  # unfinished, and no call: the model's text at a stop
    ],
    ids=["bad_json", "unknown_tool", "arguments_not_object", "unfinished"],
)
def test_a_block_that_is_not_a_call_is_kept_as_content(bad):
    text = "Hmm " + bad
    for cuts in ([], list(range(1, len(text)))):
        content, calls = parse_in_pieces(text, cuts)
        assert calls == [] and content.replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("text", ["a < b and <tool", "ends with a line break\n\n", "<tool_cal"])
def test_plain_text_comes_out_whole(text):
    for cuts in ([], list(range(1, len(text)))):
        assert parse_in_pieces(text, cuts) == (text, [])


def test_without_parallel_calls_only_the_first_counts():
    for cuts in ([5, 40], list(range(1, len(TWO_CALLS)))):
        content, calls = parse_in_pieces(TWO_CALLS, cuts, parallel=False)
        assert content == "Let me look." and named(calls) == [("get_weather", {"city": "Paris"})]


def test_a_block_the_end_closes_is_a_call_in_any_key_order():
    text = '<tool_call>\n{"arguments": {"tz": "UTC"}, "name": "get_time"}'  # no end tag
    for cuts in ([], list(range(1, len(text)))):
        content, calls = parse_in_pieces(text, cuts)
        assert content == "" and named(calls) == [("get_time", {"tz": "UTC"})]


# the forced output of two parallel calls, cut by max_tokens at every point
FORCED = block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {"tz": "CET"})


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "auto"])
def test_a_choice_cut_by_max_tokens_never_shows_markup(forced):
    """Cut anywhere, the content holds no `<tool_call>` markup: the calls are what was
    parsed (a call cut in its arguments keeps what was decoded of them), or nothing."""
    second = FORCED.index("<tool_call>", 1)
    for cut in range(len(FORCED) + 1):
        text = FORCED[:cut]
        for cuts in ([], list(range(1, len(text)))):
            content, calls = parse_in_pieces(text, cuts, truncated=True, forced=forced)
            assert "<" not in content and content.strip() == "", (cut, content)
            arguments = [c["function"]["arguments"] for c in calls]
            names = [c["function"]["name"] for c in calls]
            assert names == ["get_weather", "get_time"][: len(names)]
            # every call's arguments are a beginning of what the model wrote
            assert all(
                a and FORCED.find(a, 0 if i == 0 else second) > 0 for i, a in enumerate(arguments)
            )
        if cut == len(FORCED):
            assert named(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
        elif cut < FORCED.index('"arguments": {') + len('"arguments": {'):
            assert calls == [], cut  # the first call's head is not complete: nothing


# ---------------------------------------------------------------- the grammar
def test_closing_schemas_leaves_what_they_say_and_their_values_alone():
    schema = {
        "type": "object",
        "properties": {
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "list": {"type": "array", "items": {"type": "object", "properties": {}}},
            "fixed": {"const": {"properties": {"x": 1}}},
        },
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["properties"]["fixed"] == {"const": {"properties": {"x": 1}}}
    assert "additionalProperties" not in schema  # the request's own schema is untouched


@pytest.fixture(scope="module")
def matchers(tiny_dirs):
    from minisgl.engine.grammar import Grammars
    from minisgl.grammar import compile_item

    tokenizer = load_tokenizer(tiny_dirs["llama"])
    grammars = Grammars(tiny_dirs["llama"], len(tokenizer))

    def accepts(calling: ToolCalling, text: str) -> bool:
        matcher = grammars.build(compile_item("lark", calling.grammar())).result()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return accepts


CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", True, CALL_A, True),
        ("required", True, CALL_A + "\n" + CALL_B, True),
        ("required", False, CALL_A + "\n" + CALL_B, False),
        ("required", True, "\n".join([CALL_A] * MAX_PARALLEL_CALLS), True),
        ("required", True, "\n".join([CALL_A] * (MAX_PARALLEL_CALLS + 1)), False),  # bounded
        ("required", True, "Sure! " + CALL_A, False),  # forced: nothing but calls
        ("get_time", True, CALL_B, True),
        ("get_time", True, CALL_A, False),  # the other function
        ("get_time", True, CALL_B + "\n" + CALL_B, False),  # a named choice calls once
        ("required", True, CALL_A.replace('"Rome"', '"Oslo"'), False),  # not in the enum
        ("required", True, CALL_A.replace('"Rome"}', '"Rome", "x": 1}'), False),  # extra key
        ("required", True, CALL_A.replace('"city": "Rome"', ""), False),  # required missing
    ],
)
def test_the_forcing_grammar_accepts_exactly_the_calls_it_should(
    matchers, choice, parallel, text, ok
):
    assert matchers(ToolCalling(TOOLS, choice, parallel), text) is ok


def test_auto_needs_no_grammar():
    assert ToolCalling(TOOLS, "auto").grammar() is None


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_tiny_model_sampling_under_the_grammar_always_makes_valid_calls(tiny_dirs, choice):
    calling = ToolCalling(TOOLS, choice)
    llm = LLM(model=str(tiny_dirs["llama"]), device="cpu")
    forced = SamplingParams(temperature=1.0, max_tokens=200, n=3, seed=7, grammar=calling.grammar())
    free = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(["call something", "and something else"], [forced, free])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in outs[0].outputs:
        text = out.text
        assert out.finish_reason == "stop", text  # the grammar ended it, not max_tokens
        content, calls = parse_in_pieces(text, [])
        assert content == "" and calls, text
        for name, arguments in named(calls):
            assert choice == "required" or name == choice
            jsonschema.validate(arguments, schemas[name])
    assert llm.scheduler.state().grammar_matchers == 0


# ---------------------------------------------------------------- the request
def chat_request(**extra) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    return ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "20C"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages"),
        ({"messages": [{"role": "assistant"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ],
    ids=[
        "empty_tools", "duplicate_names", "choice_without_tools", "unknown_named_choice",
        "json_with_tools", "null_user_content", "tool_without_call_id", "call_id_not_on_tool",
        "empty_assistant", "tool_calls_not_on_assistant",
    ],
)  # fmt: skip
def test_inconsistent_tool_fields_are_refused_naming_the_field(extra, param):
    with pytest.raises(ValidationError) as info:
        chat_request(**extra)
    errors = info.value.errors()
    cause = (errors[0].get("ctx") or {}).get("error")
    where = getattr(cause, "param", None) or str(errors[0]["loc"][0])
    assert where == param, errors


# a call of get_weather and its result, as a client sends them back
CONVERSATION = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
]


def test_a_tool_conversation_reaches_the_template_as_templates_expect():
    req = chat_request(messages=CONVERSATION, tools=TOOLS, tool_choice="none")
    assistant, tool = (m.as_template_input() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}  # an object
    assert tool == {"role": "tool", "content": "20C", "tool_call_id": "call_1"}
    assert req.tool_calling() is None and req.template_tools() is None  # "none"
    assert route_params(req).grammar is None


def route_params(req: ChatCompletionRequest) -> SamplingParams:
    """The sampling parameters the chat route sends: with the request's tool-call format
    from the server's parsers (--tool-call-parser hermes, the default)."""
    return req.sampling_params(OutputParsers.chosen("hermes", None).tool_calls(req.tool_calling()))


def test_forced_choices_carry_their_grammar():
    assert route_params(chat_request(tools=TOOLS)).grammar is None  # auto by default
    forced = route_params(chat_request(tools=TOOLS, tool_choice="required"))
    assert "get_time" in forced.grammar and "get_weather" in forced.grammar
    one = {"type": "function", "function": {"name": "get_time"}}
    grammar = route_params(chat_request(tools=TOOLS, tool_choice=one)).grammar
    assert "get_time" in grammar and "get_weather" not in grammar


# ---------------------------------------------------------------- the response
def outputs(text: str, reason: str, cuts: list[int], reasoning_open: bool = False) -> list[Output]:
    """One choice's `text`, cut at `cuts`, as the frontend's successive outputs."""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [
        Output(
            [ChoiceOutput(0, piece, reason if i == len(pieces) - 1 else None, [])],
            prompt_tokens=5,
            completion_tokens=i + 1,
            finished=i == len(pieces) - 1,
            error=None,
            reasoning_open=reasoning_open,
        )
        for i, piece in enumerate(pieces)
    ]


def streamed(calling: ToolCalling, text: str, reason: str, cuts: list[int]):
    fmt = ChatFormat("m", 1, calling)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for out in outputs(text, reason, cuts):
        for payload in sse_payloads(fmt.chunks(out)):
            state.handle_chunk(ChatCompletionChunk.model_validate_json(payload))
    return state.current_completion_snapshot.choices[0]


def whole(calling: ToolCalling, text: str, reason: str):
    body = ChatFormat("m", 1, calling).body([text], [reason], None, 5, 1)
    return ChatCompletion.model_validate(body).choices[0]


@pytest.mark.parametrize(
    ("choice", "text", "reason", "expected"),
    [
        ("auto", TWO_CALLS, "stop", "tool_calls"),
        ("required", TWO_CALLS, "stop", "tool_calls"),
        ("get_time", block("get_time", {"tz": "UTC"}), "stop", "stop"),  # as OpenAI answers
        ("auto", "No tools needed.", "stop", "stop"),
        ("auto", TWO_CALLS[:-30], "length", "length"),  # cut off inside the second call
        ("required", FORCED[:-40], "length", "length"),  # a forced second call cut short
    ],
)
def test_streamed_tool_calls_add_up_to_the_whole_message(choice, text, reason, expected):
    calling = ToolCalling(TOOLS, choice)
    full = whole(calling, text, reason)
    assert full.finish_reason == expected
    for cuts in ([], [7, 20, 33, 90, 140], list(range(1, len(text)))):
        part = streamed(calling, text, reason, cuts)
        assert part.finish_reason == expected
        assert part.message.content == full.message.content
        got = [(c.function.name, c.function.arguments) for c in part.message.tool_calls or []]
        want = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
        assert got == want
    assert "<tool_call>" not in (full.message.content or "")
    if full.message.tool_calls and reason == "stop":
        assert full.message.content in (None, "Let me look.")
        for call in full.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), {"type": "object"})


def test_a_reply_cut_inside_a_call_keeps_what_was_parsed_and_no_markup():
    text = TWO_CALLS[: TWO_CALLS.index("CET") + 1]  # inside the second call's arguments
    full = whole(ToolCalling(TOOLS, "auto"), text, "length")
    assert full.finish_reason == "length" and full.message.content == "Let me look."
    first, second = full.message.tool_calls
    assert json.loads(first.function.arguments) == {"city": "Paris"}
    assert second.function.name == "get_time"
    assert second.function.arguments == '{"tz": "C'  # what was decoded of them
    forced = whole(ToolCalling(TOOLS, "required"), '<tool_call>\n{"na', "length")
    assert forced.message.content is None and forced.message.tool_calls is None


# ---------------------------------------------------------------- templates
def test_a_template_without_tools_refuses_them(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ToolsUnsupported, match="does not support tools"):
        build_prompt_ids(tokenizer, messages, TOOLS)
    tokenizer.chat_template = (
        "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ToolsUnsupported, match="format other than <tool_call>"):
        build_prompt_ids(tokenizer, messages, TOOLS)
    assert build_prompt_ids(tokenizer, messages)  # without tools it still serves


def test_the_shipped_template_shows_tools_calls_and_results(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    tokenizer.chat_template = chat_template_text("smollm2-tools")
    req = chat_request(messages=CONVERSATION, tools=TOOLS)
    messages = [m.as_template_input() for m in req.messages]
    text = tokenizer.apply_chat_template(
        messages, tools=req.template_tools(), tokenize=False, add_generation_prompt=True
    )
    assert json.dumps(TOOLS[0]["function"]) in text  # the tool, as the model sees it
    assert block("get_weather", {"city": "Rome"}) in text  # the earlier call, in its format
    assert "<tool_response>\n20C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="smollm2-tools"):
        chat_template_text("no-such-template")


# ---------------------------------------------------------------- $defs and $ref
class Address(BaseModel):
    city: Literal["Paris", "Rome"]
    zip_code: int = Field(ge=1000, le=99999)


class Person(BaseModel):
    name: Literal["Ada", "Alan"]
    home: Address
    friends: list[Person] = Field(default_factory=list, max_length=2)  # recursive


PERSON_TOOLS = [
    {"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}},
    {"type": "function", "function": {"name": "move", "parameters": Address.model_json_schema()}},
]  # fmt: skip


def person_call(arguments: dict) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": "add_person", "arguments": arguments})
        + "\n</tool_call>"
    )


@pytest.mark.parametrize("choice", ["required", "add_person"])
def test_parameters_with_defs_and_refs_are_forced_as_they_say(matchers, choice):
    """pydantic writes nested models as `$defs` and `$ref`s: under the grammar they resolve
    to the tool's own definitions (the recursive one too) and constrain the call."""
    assert "$defs" in PERSON_TOOLS[0]["function"]["parameters"]
    calling = ToolCalling(PERSON_TOOLS, choice)
    home = {"city": "Rome", "zip_code": 12345}
    good = {"name": "Ada", "home": home, "friends": [{"name": "Alan", "home": home}]}
    assert matchers(calling, person_call(good))
    assert not matchers(calling, person_call({**good, "home": {**home, "city": "Oslo"}}))
    assert not matchers(calling, person_call({**good, "home": {**home, "x": 1}}))  # closed
    nested_bad = {**good, "friends": [{"name": "Alan", "home": {"city": "Rome"}}]}
    assert not matchers(calling, person_call(nested_bad))  # the ref inside the recursion


def test_a_tiny_model_under_a_grammar_with_refs_makes_valid_calls(tiny_dirs):
    llm = LLM(model=str(tiny_dirs["llama"]), device="cpu")
    grammar = ToolCalling(PERSON_TOOLS, "add_person").grammar()
    params = SamplingParams(temperature=1.0, max_tokens=300, n=3, seed=3, grammar=grammar)
    for out in llm.generate(["who?"], params)[0].outputs:
        assert out.finish_reason == "stop", out.text
        (call,) = parse_in_pieces(out.text, [], names={"add_person"})[1]
        Person.model_validate_json(call["function"]["arguments"])
