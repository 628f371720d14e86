"""Tokenizer loading and prompt building.

Contract: `load_tokenizer(model_dir, chat_template=None)` returns a Hugging Face fast
tokenizer from a model folder, or None when the folder has no tokenizer (a bare config for
--dummy-weights benchmarks: such a model takes token ids only); `chat_template` (a file or
the name of one shipped in minisgl/templates/) replaces the model's own.
`build_prompt_ids(tokenizer, prompt, tools=None, ...)` turns what a user sent (plain text,
chat messages, or token ids) into prompt token ids: chat messages go through the chat
template with the generation prompt appended (or the last message continued), with the
request's tools when it has some and its extra template variables; plain text is encoded
as is. `escape_special=True` (--escape-special-tokens) tokenizes the messages' texts as
plain text: control tokens typed into a message stay characters.
`reasoning_open(tokenizer, ids, parser)` says whether a prompt leaves the model inside a
`<think>` block (--reasoning-parser).

Tool calls are read back from the output in one format, Hermes-style `<tool_call>` blocks
of JSON (Qwen2.5, Qwen3, and the template shipped for the embedded SmolLM2). A template
that does not render the tools it is given, or renders them for another format, cannot
serve `tools`: `ToolsUnsupported` says so before anything is generated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from minisgl.templates import (
    REASONING_STARTS_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALL_START,
    chat_template_text,
)

Prompt = str | list[int] | list[dict[str, Any]]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ToolsUnsupported(ValueError):
    """The chat template cannot present tools to the model in the `<tool_call>` format."""


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() for name in _TOKENIZER_FILES):
        return None
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    return tokenizer


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "minisgl_probe", "description": "", "parameters": {"type": "object"}},
}
_tool_support: dict[str, str | None] = {}  # template text -> why it cannot serve tools


def _check_tools(tokenizer) -> None:
    """Raise ToolsUnsupported unless the chat template shows tools in the `<tool_call>`
    format. Found out once per template, by rendering a probe tool."""
    template = str(tokenizer.chat_template)
    if template not in _tool_support:
        probe = [{"role": "user", "content": "?"}]
        try:
            text = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False)
        except Exception as e:
            text = f"(fails: {e})"
        if "minisgl_probe" not in text:
            why = "this model's chat template does not support tools"
        elif TOOL_CALL_START not in text:
            why = f"this model's chat template calls tools in a format other than {TOOL_CALL_START}"
        else:
            why = None
        _tool_support[template] = why
    if (why := _tool_support[template]) is not None:
        raise ToolsUnsupported(why)


def build_prompt_ids(
    tokenizer,
    prompt: Prompt,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    escape_special: bool = False,
) -> list[int]:
    """`add_generation_prompt`, `continue_final_message` (the last message left open, for
    the model to go on with) and `template_kwargs` (more variables for the template, such
    as `enable_thinking`) reach the chat template as transformers passes them."""
    if tokenizer is None and not all(isinstance(t, int) for t in prompt):
        raise ValueError("this model folder has no tokenizer: give prompts as token ids")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        if tools:
            _check_tools(tokenizer)
        options = dict(
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        if escape_special:
            return _escaped_chat_ids(tokenizer, prompt, options)
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, **options)
        if isinstance(ids, dict) or hasattr(
            ids, "input_ids"
        ):  # transformers 5 returns BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if not prompt:
        return []
    raise TypeError("a prompt is a string, a list of token ids or a list of chat messages")


_MARK = re.compile("\ue000(\\d+)\ue001")  # a message's content, in a rendered template


def _escaped_chat_ids(tokenizer, messages: list[dict], options: dict) -> list[int]:
    """The chat template's tokens with every message's text tokenized as plain text: a
    `<|im_start|>system` typed into a message is those characters, not the control token
    that opens a turn (so a user cannot forge a system turn). The template is rendered with
    a marker in place of each text, and the texts are tokenized apart, special tokens
    split into ordinary ones."""
    texts: list[str] = []

    def mark(text: str) -> str:
        texts.append(text)
        return f"\ue000{len(texts) - 1}\ue001"

    masked = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            m = {**m, "content": mark(content)}
        elif isinstance(content, list):
            parts = [
                {**p, "text": mark(p["text"])} if isinstance(p.get("text"), str) else p
                for p in content
            ]
            m = {**m, "content": parts}
        masked.append(m)
    rendered = tokenizer.apply_chat_template(masked, tokenize=False, **options)
    ids: list[int] = []
    for i, piece in enumerate(_MARK.split(rendered)):
        if i % 2 == 0:  # the template's own text: its control tokens are real
            ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            text = texts[int(piece)]
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids


def reasoning_open(tokenizer, ids: list[int], parser: str) -> bool:
    """Whether the output after prompt `ids` starts inside a think block: the prompt's
    last marker is `<think>` (the template opened the block), or, with neither marker in
    the prompt, what `parser` expects of its models (REASONING_STARTS_OPEN)."""
    start, end = _token_id(tokenizer, THINK_START), _token_id(tokenizer, THINK_END)
    if start is not None and end is not None:  # one token each: search the ids themselves
        backwards = ids[::-1]
        last_start = len(ids) - backwards.index(start) if start in backwards else 0
        last_end = len(ids) - backwards.index(end) if end in backwards else 0
        if last_start or last_end:
            return last_start > last_end
    else:  # markers of several tokens: the prompt's end, as text
        tail = tokenizer.decode(ids[-256:], skip_special_tokens=False)
        if THINK_START in tail or THINK_END in tail:
            return tail.rfind(THINK_START) > tail.rfind(THINK_END)
    return REASONING_STARTS_OPEN[parser]


def _token_id(tokenizer, token: str) -> int | None:
    """The id of `token` when the vocabulary has it as one token."""
    i = tokenizer.convert_tokens_to_ids(token)
    if i is None or i == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    return i


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet (GPT-2 and its descendants): every byte is one printable
    character; printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The exact bytes each token stands for (a token may hold part of a character)."""
    out = []
    for piece in tokenizer.convert_ids_to_tokens(ids):
        piece = piece or ""
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # SentencePiece byte fallback
            out.append(bytes([int(m[1], 16)]))
        elif all(c in _UNICODE_TO_BYTE for c in piece):  # byte-level BPE
            out.append(bytes(_UNICODE_TO_BYTE[c] for c in piece))
        else:  # SentencePiece word pieces: "▁" is a space
            out.append(piece.replace("\u2581", " ").encode())
    return out


def longest_token_bytes(tokenizer) -> int:
    """The most bytes of text one token of `tokenizer` stands for: a text of n bytes is at
    least n / this many tokens, whatever it says."""
    return max(1, max(map(len, token_bytes(tokenizer, list(range(len(tokenizer))))), default=1))
