"""Reasoning output: the `<think>` block of a reasoning model (Qwen3, DeepSeek-R1) read out
of a choice's text, so that it reaches the client as `reasoning_content`, never as content.
`--reasoning-parser qwen3` and `deepseek-r1` both choose it.

Contract: `ReasoningParser(in_reasoning)` is made per choice when the server runs with
`--reasoning-parser`; `in_reasoning` says whether the output starts inside the block (the
tokenizer worker finds out from the prompt: a template that ends the prompt with an open
`<think>`, as DeepSeek-R1's and Qwen3's thinking-only templates do, sends
`UserReply.reasoning_open`). Otherwise a `<think>` at the start of the output (whitespace
aside) opens the block. `feed(text)` returns `(reasoning, content)` that can be sent now;
`close()` returns the rest when the choice ends. The text between the markers is the
reasoning, without the whitespace at its ends; the text after `</think>` is the content,
without the whitespace that follows the marker. Text that could still be a marker, or
whitespace that could still end the reasoning or begin the content, is held back, so the
pieces of a streamed choice add up to the whole choice's split wherever the text is cut.
A `<think>` anywhere but the start is content, as is everything when no block opens.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.templates import THINK_END, THINK_START

from .markers import partial_suffix

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass
class ReasoningParser:
    in_reasoning: bool = False
    _state: str = _START
    _held: str = ""
    _reasoning_begun: bool = False  # reasoning text went out: its leading space is over
    _strip_content: bool = False  # the block just closed: drop the space before the answer

    def __post_init__(self) -> None:
        self._state = _REASONING if self.in_reasoning else _START

    # --8<-- [start:reasoning_feed]
    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` lets out now."""
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self._state == _START:  # the output's start: does it open a block?
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_START):
                    self._held, self._state = stripped[len(THINK_START) :], _REASONING
                elif not stripped or THINK_START.startswith(stripped):
                    break  # could still be `<think>`
                else:
                    self._state = _CONTENT  # an answer without a block, sent as it is
            elif self._state == _REASONING:
                if not self._reasoning_begun:  # a model may repeat the prompt's `<think>`
                    stripped = self._held.lstrip()
                    if stripped.startswith(THINK_START):
                        self._held = stripped[len(THINK_START) :]
                        continue
                    if stripped and THINK_START.startswith(stripped):
                        break
                end = self._held.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._reasoning(self._held[:end].rstrip()))
                    self._held, self._state = self._held[end + len(THINK_END) :], _CONTENT
                    self._strip_content = True
                    continue
                # hold back a possible `</think>` and the whitespace before it
                keep = partial_suffix(self._held, THINK_END)
                keep = len(self._held[:keep].rstrip())
                reasoning.append(self._reasoning(self._held[:keep]))
                self._held = self._held[keep:]
                break
            else:
                content.append(self._content(self._held))
                self._held = ""
        return "".join(reasoning), "".join(content)

    # --8<-- [end:reasoning_feed]

    def close(self) -> tuple[str, str]:
        """What is still held back when the choice ends, as (reasoning, content)."""
        rest, self._held = self._held, ""
        if self._state == _REASONING:
            return self._reasoning(rest.rstrip()), ""  # cut off while reasoning
        if self._state == _START:
            return "", rest  # whitespace, or the start of `<think>` that never came
        return "", self._content(rest)

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip()
            self._reasoning_begun = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self._strip_content:
            text = text.lstrip()
            self._strip_content = not text
        return text
