"""How one chat choice's text splits into reasoning, content and tool calls, with the
output parsers the server's flags chose (minisgl/parsers/): the chat format's one tie to
them, by interface.

Contract: `ToolCalls` is what a request's tool-call format offers (minisgl/parsers/'
registry makes one per request). `ChoiceText(tools, reasoning)` follows one choice: `feed
(text, finish_reason)` returns (reasoning, content, tool-call deltas) for its next text,
all that was held back once `finish_reason` says nothing more comes; `calls` are the calls
so far, whole; `completed_calls()` those completed since last asked (for a format that
sends each call at once: responses/format.py).
"""

from __future__ import annotations

from typing import Any, Protocol


class ToolCalls(Protocol):
    """One request's tool-call format (minisgl/parsers/: a flag chooses it)."""

    forced: bool

    def grammar(self) -> str | None: ...

    def parser(self) -> Any: ...

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None: ...


class ChoiceText:
    """How one chat choice's text splits: the think block into reasoning (with a
    reasoning parser), tool-call blocks into tool-call deltas (with tools), the rest into
    content."""

    def __init__(self, tools: ToolCalls | None, reasoning: Any) -> None:
        self.reasoning = reasoning
        self.tools = tools.parser() if tools is not None else None
        self._given = 0  # calls completed_calls() has returned

    def feed(self, text: str, finish_reason: str | None) -> tuple[str, str, list[dict]]:
        """(reasoning, content, tool-call deltas) for the choice's next text; a
        `finish_reason` says that nothing more comes, so what was held goes out too."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if finish_reason is not None and self.reasoning is not None:
            more_reasoning, more = self.reasoning.close()
            reasoning, content = reasoning + more_reasoning, content + more
        if self.tools is None:
            return reasoning, content, []
        if finish_reason is None:
            return reasoning, *self.tools.feed(content)
        return reasoning, *self.tools.finish(content, truncated=finish_reason == "length")

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.tools.calls if self.tools is not None else []

    def completed_calls(self) -> list[dict[str, Any]]:
        """The calls completed since the last time asked, whole (responses/format.py)."""
        done = self.tools.done if self.tools is not None else 0
        new, self._given = self.calls[self._given : done], done
        return new
