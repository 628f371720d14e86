"""Tool calls in the Hermes `<tool_call>` format: the grammar that forces them, and the
parser that reads them out of the generated text.

Contract:
- `ToolCalling(tools, choice, parallel)` holds what one chat request asked for: its tools
  (OpenAI's `{"type": "function", "function": {...}}`), `tool_choice` ("auto", "required"
  or a function's name) and `parallel_tool_calls`.
- `grammar()` is None for "auto" (the model decides, and its markup is parsed), else an
  llguidance Lark grammar that allows only tool-call blocks: for "required" one block, or
  with `parallel` one to MAX_PARALLEL_CALLS separated by line breaks; for a named
  function exactly one. Each block holds `{"name": ..., "arguments": ...}` where the name
  is one of the tools (the named one) and the arguments validate against that tool's
  `parameters`. As
  in xgrammar's strict mode, an object schema with `properties` that does not say whether
  other keys are allowed gets none: a small model otherwise invents extra arguments.
- `parser()` makes a `ToolCallParser` for one choice. `feed(text)` takes the choice's
  next text and returns what can be sent now: the content text and the tool calls whose
  block has closed. Text that could still become a block is held back (whitespace before
  a block too, so the content does not end in the line break that led to it); `close()`
  returns the rest when the choice ends. A block whose JSON does not parse, or names no
  tool of the request, is content, as the model wrote it: nothing is lost. Without
  `parallel`, calls after the first are dropped.
- `finish_reason(reason, made_calls)`: "stop" becomes "tool_calls" when the choice called
  tools, except for a named tool_choice, which OpenAI answers with "stop".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from minisgl.tokenizer.tokenize import TOOL_CALL_END, TOOL_CALL_START

AUTO, REQUIRED = "auto", "required"
# forced parallel calls per answer: a small model under the grammar can otherwise repeat
# the same call until the context is full
MAX_PARALLEL_CALLS = 8


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object lists its
    `properties` and leaves other keys unsaid (values such as `const` stay as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON inside one tool-call block for `function`."""
    # no parameters: a function that takes none (OpenAI's "empty parameter list")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _closed(parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@dataclass
class ToolCalling:
    tools: list[dict[str, Any]]
    choice: str = AUTO  # "auto", "required", or the name of the function to call
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    # --8<-- [start:tool_grammar]
    def grammar(self) -> str | None:
        """The Lark grammar that forces tool calls; None when the model may answer freely."""
        if self.choice == AUTO:
            return None
        functions = [
            t["function"]
            for t in self.tools
            if self.choice == REQUIRED or t["function"]["name"] == self.choice
        ]
        schema = {
            "anyOf": [_call_schema(f) for f in functions],
            # the spacing of the template's own example (and of json.dumps)
            "x-guidance": {
                "whitespace_flexible": False,
                "item_separator": ", ",
                "key_separator": ": ",
            },
        }
        several = self.parallel and self.choice == REQUIRED
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if several else ""
        start = f"start: call {more}"
        block = f"call: {json.dumps(TOOL_CALL_START + chr(10))} body {json.dumps(chr(10) + TOOL_CALL_END)}"
        return f"{start}\n{block}\nbody: %json {json.dumps(schema)}\n"

    # --8<-- [end:tool_grammar]

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.names, self.parallel)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        if reason == "stop" and made_calls and self.choice in (AUTO, REQUIRED):
            return "tool_calls"
        return reason


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One entry of `message.tool_calls`, as OpenAI sends it (arguments as JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _partial_suffix(text: str, marker: str) -> int:
    """Where the longest end of `text` that could begin `marker` starts (len(text): none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


@dataclass
class ToolCallParser:
    names: set[str]
    parallel: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call parsed so far
    _held: str = ""  # text not yet sent: could start a block, or is a block still open
    _in_block: bool = False

    # --8<-- [start:tool_parser]
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content that can be sent now and the calls completed by `text`."""
        self._held += text
        content, calls = [], []
        while True:
            if self._in_block:
                end = self._held.find(TOOL_CALL_END)
                if end < 0:
                    break  # the block is still open
                block = self._held[: end + len(TOOL_CALL_END)]
                self._held, self._in_block = self._held[len(block) :], False
                call = self._parse(block[len(TOOL_CALL_START) : end])
                if call is None:
                    content.append(block)  # not a call after all: the model's text
                elif self.parallel or not self.calls:
                    self.calls.append(call)
                    calls.append(call)
                continue
            start = self._held.find(TOOL_CALL_START)
            if start >= 0:
                before = self._held[:start]
                content.append(before.rstrip() if not before.isspace() else "")
                self._held, self._in_block = self._held[start:], True
                continue
            # hold back a possible start of a block, and the whitespace in front of it
            keep = _partial_suffix(self._held, TOOL_CALL_START)
            keep = len(self._held[:keep].rstrip()) if keep else 0
            content.append(self._held[:keep])
            self._held = self._held[keep:]
            break
        return "".join(content), calls

    # --8<-- [end:tool_parser]

    def close(self) -> str:
        """The text still held back when the choice ends (an unfinished block included)."""
        rest, self._held = self._held, ""
        if not self._in_block and rest.isspace() and self.calls:
            return ""  # the line break after the last call
        return rest

    def _parse(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return tool_call(value["name"], arguments)
