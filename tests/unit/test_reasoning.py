"""Reasoning output without a server: the `<think>` parser (text split at every position
reads like the whole), the chat format's `reasoning_content` streamed and not (with tool
calls after the reasoning), and the tokenizer's view of whether a prompt leaves the model
inside its think block."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_tool_calls import outputs
from tiny import make_tokenizer

from minisgl.parsers.hermes import ToolCalling
from minisgl.parsers.think import ReasoningParser
from minisgl.server.chat import ChatFormat
from minisgl.testing.sse import sse_payloads
from minisgl.tokenizer.tokenize import reasoning_open

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (output text, starts inside the block) -> (reasoning, content)
CASES = {
    "qwen3": (("<think>\nLet me think.\n</think>\n\nParis.", False), ("Let me think.", "Paris.")),
    "r1_open_prompt": (("Hmm, France.\n</think>\n\nParis.", True), ("Hmm, France.", "Paris.")),
    "no_block": (("  Paris, of course.", False), ("", "  Paris, of course.")),
    "late_think_is_content": (("Paris <think>x</think>", False), ("", "Paris <think>x</think>")),
    "cut_while_thinking": (("<think>\nstill going ", False), ("still going", "")),
    "repeated_open_marker": (("<think>\nx\n</think>y", True), ("x", "y")),
    "empty_block": (("<think>\n\n</think>\n\nHi", False), ("", "Hi")),
    "lt_in_reasoning": (("<think>a < b </thin</think>ok", False), ("a < b </thin", "ok")),
    "just_a_start": (("<thi", False), ("", "<thi")),
}


def parse(text: str, in_reasoning: bool, cuts: list[int]) -> tuple[str, str]:
    parser = ReasoningParser(in_reasoning)
    reasoning, content = "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.close()
    return reasoning + r, content + c


@pytest.mark.parametrize("case", list(CASES))
def test_text_split_at_every_position_reads_like_the_whole(case):
    (text, in_reasoning), expected = CASES[case]
    assert parse(text, in_reasoning, []) == expected
    for cut in range(1, len(text)):
        assert parse(text, in_reasoning, [cut]) == expected, cut
        assert parse(text, in_reasoning, list(range(cut, len(text)))) == expected, cut
    assert parse(text, in_reasoning, list(range(1, len(text)))) == expected


# ---------------------------------------------------------------- through the chat format
def streamed(text: str, reason: str, cuts: list[int], tools=None, reasoning_open=False):
    """The streamed choice as the official client assembles it, and the reasoning
    deltas joined (the client keeps unknown delta fields but does not join them)."""
    fmt = ChatFormat("m", 1, ToolCalling(tools) if tools else None, reasoning=ReasoningParser)
    state = ChatCompletionStreamState(input_tools=tools or [])
    reasoning = ""
    for out in outputs(text, reason, cuts, reasoning_open):
        for payload in sse_payloads(fmt.chunks(out)):
            state.handle_chunk(ChatCompletionChunk.model_validate_json(payload))
            delta = json.loads(payload)["choices"][0]["delta"]
            assert "<think>" not in delta.get("content", "") + delta.get("reasoning", "")
            assert delta.get("reasoning") == delta.get("reasoning_content")  # both names
            reasoning += delta.get("reasoning", "")
    return state.current_completion_snapshot.choices[0], reasoning


def whole(text: str, reason: str, tools=None, reasoning_open=False):
    fmt = ChatFormat("m", 1, ToolCalling(tools) if tools else None, reasoning=ReasoningParser)
    body = fmt.body([text], [reason], None, 5, 1, reasoning_open=reasoning_open)
    return ChatCompletion.model_validate(body).choices[0]


@pytest.mark.parametrize(
    ("text", "tools", "reasoning_open", "want"),
    [
        ("<think>\nWeather needs a tool.\n</think>\n\n" + CALL, TOOLS, False, "tool_calls"),
        ("Weather needs a tool.\n</think>\n\nSure. " + CALL, TOOLS, True, "tool_calls"),
        ("<think>\nI could " + CALL + "\n</think>\n\nParis.", TOOLS, False, "stop"),
        ("<think>\nshort\n</think>\n\nParis.", None, False, "stop"),
    ],
    ids=["call_after_reasoning", "open_prompt_then_call", "markup_inside_reasoning", "plain"],
)
def test_reasoning_streams_apart_and_adds_up_to_the_whole_message(
    text, tools, reasoning_open, want
):
    full = whole(text, "stop", tools, reasoning_open)
    assert full.finish_reason == want
    reasoning = full.message.model_extra["reasoning"]
    assert full.message.model_extra["reasoning_content"] == reasoning  # the older name
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert "think>" not in (full.message.content or "")
    assert "<tool_call>" not in (full.message.content or "")
    if want == "tool_calls":
        (call,) = full.message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
    for cuts in ([], [3, 9, 30, 51], list(range(1, len(text)))):
        part, part_reasoning = streamed(text, "stop", cuts, tools, reasoning_open)
        assert part_reasoning == reasoning and part.finish_reason == want
        assert part.message.content == full.message.content
        got = [(c.function.name, c.function.arguments) for c in part.message.tool_calls or []]
        want_calls = [
            (c.function.name, c.function.arguments) for c in full.message.tool_calls or []
        ]
        assert got == want_calls


def test_without_a_reasoning_parser_the_markup_is_content():
    body = ChatFormat("m", 1).body(["<think>x</think>y"], ["stop"], None, 5, 1)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>x</think>y"}


def test_an_answer_cut_while_reasoning_has_no_content():
    full = whole("<think>\nstill thinking", "length")
    assert full.finish_reason == "length" and full.message.content is None
    assert full.message.model_extra["reasoning_content"] == "still thinking"


# ---------------------------------------------------------------- the prompt's think block
@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("think"))
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special
    return tok


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # a thinking template opened the block
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking turned off
        ("<think>old</think> x <think>\npartial", True),  # continue_final_message
        ("<|im_start|>assistant\n", None),  # no marker: the parser's own expectation
    ],
)
def test_the_prompt_says_whether_the_output_starts_in_reasoning(
    think_tokenizer, parser, prompt, opens
):
    ids = think_tokenizer.encode(prompt, add_special_tokens=False)
    expected = opens if opens is not None else parser == "deepseek-r1"
    assert reasoning_open(think_tokenizer, ids, parser) is expected


def test_markers_of_several_tokens_are_found_in_the_text(tmp_path):
    tok = make_tokenizer(tmp_path)  # no think tokens: "<think>" is several byte tokens
    ids = tok.encode("assistant\n<think>\n", add_special_tokens=False)
    assert len(ids) > 2 and reasoning_open(tok, ids, "qwen3") is True
    ids = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert reasoning_open(tok, ids, "deepseek-r1") is False


def test_the_template_fields_shape_the_prompt(tmp_path):
    from minisgl.tokenizer.tokenize import build_prompt_ids

    tok = make_tokenizer(tmp_path)
    tok.chat_template += "{% if enable_thinking is defined and not enable_thinking %}/no{% endif %}"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The cap"}]

    def text(**options) -> str:
        return tok.decode(build_prompt_ids(tok, chat, **options))

    assert text().endswith("The cap<|im_end|>\n<|im_start|>assistant\n")
    assert text(add_generation_prompt=False).endswith("The cap<|im_end|>\n")
    assert text(add_generation_prompt=False, continue_final_message=True).endswith("The cap")
    off = text(template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\n/no") and not text().endswith("/no")
