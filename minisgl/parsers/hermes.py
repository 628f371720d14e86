"""Tool calls in the Hermes `<tool_call>` format (Qwen2.5, Qwen3, the embedded model's
template): the grammar that forces them, and the parser that reads them out of the
generated text. `--tool-call-parser hermes`, the default.

Contract:
- `ToolCalling(tools, choice, parallel)` is the format for what one chat request asked:
  its tools (OpenAI's `{"type": "function", "function": {...}}`), `tool_choice` ("auto",
  "required" or a function's name) and `parallel_tool_calls`.
- `grammar()` is None for "auto" (the model decides, and its markup is parsed), else an
  llguidance Lark grammar that allows only tool-call blocks: for "required" one block, or
  with `parallel` one to MAX_PARALLEL_CALLS separated by line breaks; for a named
  function exactly one. Each block holds `{"name": ..., "arguments": ...}` where the name
  is one of the tools (the named one) and the arguments validate against that tool's
  `parameters` (closed: minisgl/utils/jsonschema.py); `$ref`s inside them (pydantic writes
  one for every nested model) point into the tool's own `$defs`, wherever the grammar
  embeds it.
- `parser()` makes a `ToolCallParser` for one choice. `feed(text)` takes the choice's
  next text and returns what can be sent now: the content text and the tool-call deltas.
  A call's first delta carries its `id`, `type` and `function.name` once the block's
  `{"name": ..., "arguments": ` has been read; its arguments then follow piece by piece
  as they are decoded (OpenAI's and vLLM's streaming shape); `calls` holds every call
  whole. Text that could still become a block is held back (whitespace before a block
  too, so the content does not end in the line break that led to it). `close(truncated)`
  returns the rest when the choice ends, `finish(text, truncated)` both at once. A block
  that does not begin like a call of one of the request's tools is content when it
  closes, as the model wrote it: nothing is lost; but template markup never reaches the
  content of a choice cut short by max_tokens (`truncated`): an unfinished block is
  dropped there, and a call whose arguments were cut keeps what was decoded of them.
  Without `parallel`, calls after the first are dropped.
- `finish_reason(reason, made_calls)`: "stop" becomes "tool_calls" when the choice called
  tools, except for a named tool_choice, which OpenAI answers with "stop".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from minisgl.templates import TOOL_CALL_END, TOOL_CALL_START
from minisgl.utils.jsonschema import closed_schema

from .markers import partial_suffix

AUTO, REQUIRED = "auto", "required"
# forced parallel calls per answer: a small model under the grammar can otherwise repeat
# the same call until the context is full
MAX_PARALLEL_CALLS = 8


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#...") pointing below `base` instead of the root."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value  # values, not schemas
        else:
            out[key] = _rebased(value, base)
    return out


def _call_schema(function: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The JSON inside one tool-call block for `function`. Its parameters go into `defs`
    (the grammar's root `$defs`), so that their own `$ref`s still resolve there."""
    # no parameters: a function that takes none (OpenAI's "empty parameter list")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    key = f"minisgl_tool_{len(defs)}"
    defs[key] = _rebased(closed_schema(parameters), f"#/$defs/{key}")
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": {"$ref": f"#/$defs/{key}"},
        },
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

    @property
    def forced(self) -> bool:
        return self.choice != AUTO

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
        defs: dict[str, Any] = {}
        schema = {
            "anyOf": [_call_schema(f, defs) for f in functions],
            "$defs": defs,
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
        return ToolCallParser(self.names, self.parallel, self.forced)

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        if reason == "stop" and made_calls and self.choice in (AUTO, REQUIRED):
            return "tool_calls"
        return reason


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of `message.tool_calls`, as OpenAI sends it (arguments as JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# the start of a block's JSON, up to its arguments object: what makes the block a call
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')

# where the parser is in a choice's text
_TEXT, _HEAD, _ARGUMENTS, _TAIL = "text", "head", "arguments", "tail"


@dataclass
class ToolCallParser:
    names: set[str]
    parallel: bool = True
    forced: bool = False  # the grammar allows only calls: no text is ever content
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call, whole so far
    done: int = 0  # calls[:done] are complete (their block closed, or the choice ended)
    _held: str = ""  # text not yet sent: could start a block, or the open block's head
    _state: str = _TEXT
    _call: dict[str, Any] | None = None  # the call whose arguments are being read
    _depth: int = 0  # nesting inside the arguments' JSON
    _in_string: bool = False
    _escaped: bool = False

    # --8<-- [start:tool_parser]
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content that can be sent now and the tool-call deltas that `text` makes."""
        self._held += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._held:
            if self._state == _TEXT:  # content, up to the start of a block
                start = self._held.find(TOOL_CALL_START)
                if start < 0:  # hold back a possible start, and the whitespace before it
                    keep = partial_suffix(self._held, TOOL_CALL_START)
                    keep = len(self._held[:keep].rstrip()) if keep else 0
                    content.append(self._held[:keep])
                    self._held = self._held[keep:]
                    break
                before = self._held[:start]
                content.append(before.rstrip() if not before.isspace() else "")
                self._held, self._state = self._held[start + len(TOOL_CALL_START) :], _HEAD
            elif self._state == _HEAD:  # inside a block, before it is known to be a call
                if not self._read_head(content, deltas):
                    break
            elif self._state == _ARGUMENTS:  # a call's arguments, sent as they come
                piece = self._read_arguments()
                if piece:
                    self._add_arguments(piece, deltas)
            else:  # after the arguments: the rest of the block is markup
                end = self._held.find(TOOL_CALL_END)
                if end < 0:
                    self._held = self._held[partial_suffix(self._held, TOOL_CALL_END) :]
                    break
                self._held, self._state = self._held[end + len(TOOL_CALL_END) :], _TEXT
                self.done = len(self.calls)
        return ("" if self.forced else "".join(content)), merge_deltas(deltas)

    # --8<-- [end:tool_parser]

    def close(self, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """What is still held back when the choice ends: the content, and the deltas of a
        call that only the end completes. `truncated`: max_tokens ended the choice, so an
        unfinished block (or the start of one) is markup to drop, not the model's text."""
        rest, self._held = self._held, ""
        state, self._state = self._state, _TEXT
        content, deltas = "", []
        if state == _HEAD and not truncated:
            call = self._parse(rest)  # a block that only the end closes
            if call is None:
                content = TOOL_CALL_START + rest  # not a call: the model's text
            elif self.parallel or not self.calls:
                deltas = self._new_call(call["function"]["name"], call["function"]["arguments"])
        elif state == _TEXT and not (rest.isspace() and self.calls):
            # (whitespace after the last call is the template's, and a cut-off start of
            # a block is markup)
            content = "" if truncated and rest.strip() else rest
        self.done = len(self.calls)
        return ("" if self.forced else content), deltas

    def finish(self, text: str, truncated: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """`feed(text)` and then `close(truncated)`: the choice's last text."""
        content, deltas = self.feed(text)
        rest, more = self.close(truncated)
        return content + rest, merge_deltas(deltas + more)

    def _read_head(self, content: list[str], deltas: list[dict[str, Any]]) -> bool:
        """Read the open block's head; False when more text is needed."""
        head = _CALL_HEAD.match(self._held)
        if head is not None and head[1] in self.names:
            self._held = self._held[head.end() :]
            if self.parallel or not self.calls:
                deltas += self._new_call(head[1], "")
                self._state = _ARGUMENTS
                self._depth, self._in_string, self._escaped = 0, False, False
            else:  # a call after the first without parallel calls: dropped
                self._state = _TAIL
            return True
        end = self._held.find(TOOL_CALL_END)
        if end < 0:
            return False
        # the block closed without a call's head: a call in another key order, or text
        body, self._held = self._held[:end], self._held[end + len(TOOL_CALL_END) :]
        self._state = _TEXT
        call = self._parse(body)
        if call is None:
            content.append(TOOL_CALL_START + body + TOOL_CALL_END)
        elif self.parallel or not self.calls:
            deltas += self._new_call(call["function"]["name"], call["function"]["arguments"])
            self.done = len(self.calls)
        return True

    def _read_arguments(self) -> str:
        """The held text up to the end of the arguments' JSON object (all of it while the
        object is still open); past its end the block's tail follows."""
        for i, c in enumerate(self._held):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                continue
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    piece, self._held = self._held[: i + 1], self._held[i + 1 :]
                    self._state = _TAIL
                    return piece
            elif c == "<":  # JSON has no "<" outside strings: the block ends unfinished
                piece, self._held = self._held[:i], self._held[i:]
                self._state = _TAIL
                return piece
        piece, self._held = self._held, ""
        return piece

    def _new_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        call = tool_call(name, arguments)
        self.calls.append(call)
        self._call = call
        first = {**call, "function": {"name": name, "arguments": arguments}}  # a copy
        return [{"index": len(self.calls) - 1, **first}]

    def _add_arguments(self, piece: str, deltas: list[dict[str, Any]]) -> None:
        self._call["function"]["arguments"] += piece
        deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})

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
        return tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))


def merge_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One delta per call: its pieces from one feed joined (the first keeps id and name)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out
