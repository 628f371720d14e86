"""Output parsers: how a chat answer's text splits into reasoning, content and tool calls,
behind a registry chosen by flag. The chat format (minisgl/server/chat.py) knows only the
interfaces below, never a model family's markup.

Contract:
- `TOOL_CALL_PARSERS[name](tools, choice, parallel)` (`--tool-call-parser`, "hermes" by
  default) is one request's tool-call format: `forced`, `grammar()` (the Lark grammar that
  forces calls, None when the model may answer freely), `parser()` (one choice's parser:
  `feed(text)` and `finish(text, truncated)` give (content, tool-call deltas), `calls` the
  calls so far, whole, and `done` how many of them are complete), and
  `finish_reason(reason, made_calls)`.
- `REASONING_PARSERS[name](in_reasoning)` (`--reasoning-parser`) is one choice's reasoning
  parser: `feed(text)` and `close()` give (reasoning, content).
- `OutputParsers.chosen(tool_call_parser, reasoning_parser)` is the server's pair, which
  the chat routes read from the app's state: `tool_calls(use)` makes the tool-call format
  of a request's tools (None without tools), `reasoning` is the reasoning parser's class
  (None: no parser chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import hermes, think

TOOL_CALL_PARSERS: dict[str, Callable[..., Any]] = {"hermes": hermes.ToolCalling}
REASONING_PARSERS: dict[str, Callable[[bool], Any]] = {
    "qwen3": think.ReasoningParser,
    "deepseek-r1": think.ReasoningParser,
}


@dataclass(frozen=True)
class OutputParsers:
    tool_call_format: Callable[..., Any]
    reasoning: Callable[[bool], Any] | None = None

    @classmethod
    def chosen(cls, tool_call_parser: str, reasoning_parser: str | None) -> OutputParsers:
        reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        return cls(TOOL_CALL_PARSERS[tool_call_parser], reasoning)

    def tool_calls(self, use: Any) -> Any:
        """The tool-call format of a request's tool use (a `ToolUse`, or None: no tools)."""
        if use is None:
            return None
        return self.tool_call_format(use.tools, use.choice, use.parallel)
