"""Response bodies in the OpenAI wire format, for chat and for plain completions.

Contract: a format object is made per HTTP request (it holds the id, creation time, model
name and what was already sent) and turns the frontend's coalesced `Output`s into
- `chunks(output)`: the SSE bytes of one output (a choice's first chunk carries
  role "assistant" in chat; a choice that ended gets a chunk with its finish_reason; an
  error after streaming began is one `data: {"error": ...}` event),
- `closing(output, include_usage)`: what ends the stream: the usage chunk asked for by
  `stream_options.include_usage`, then `data: [DONE]`; with `continuous_usage` (vLLM's
  `stream_options.continuous_usage_stats`) every chunk also carries the usage so far,
- `body(...)`: the whole non-streaming response,
- `error(error_info)`: the HTTP error answer on this endpoint (it names its prompt field).
The shapes validate as the `openai` client's `ChatCompletion(Chunk)` and `Completion`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from minisgl.message import ErrorInfo, TokenInfo

from .buffer import ChoiceOutput, Output
from .errors import HttpError, to_http
from .reasoning import ReasoningParser
from .tools import ToolCalling, ToolCallParser, merge_deltas

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: ...` and the blank line that ends it."""
    return b"data: " + _json.encode(payload) + b"\n\n"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:  # None: not told (--hide-cached-tokens)
        # as OpenAI reports it: prompt tokens whose computation was reused
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class _Format:
    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str  # the request field that holds the prompt, named by prompt errors

    def __init__(self, model: str, n_choices: int = 1, continuous_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n_choices = n_choices
        self.continuous_usage = continuous_usage
        self._started: set[int] = set()  # choices whose first chunk went out

    def error(self, error: ErrorInfo) -> HttpError:
        """The answer to a failed request on this endpoint."""
        return to_http(error, self.prompt_param)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # --8<-- [start:chunks]
    def chunks(self, output: Output) -> bytes:
        """The SSE bytes for one coalesced output."""
        out = b""
        for choice in output.choices:
            first = choice.index not in self._started
            self._started.add(choice.index)
            delta = self._delta(choice, first, output)
            if delta is not None:
                out += sse(self._chunk(delta, output))
            if choice.finish_reason is not None and output.error is None:
                out += sse(self._chunk(self._end(choice), output))
        if output.error is not None:  # after the first byte an error can only be an event
            out += sse(self.error(output.error).body())
        return out

    # --8<-- [end:chunks]

    def _chunk(self, choice: dict[str, Any], output: Output) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, [choice])
        if self.continuous_usage:
            body["usage"] = usage(
                output.prompt_tokens, output.completion_tokens, output.cached_tokens
            )
        return body

    def closing(self, output: Output, include_usage: bool) -> bytes:
        """What ends the stream after the last output's chunks: the usage chunk when asked
        (and nothing failed), then `data: [DONE]`."""
        usage = include_usage and output.error is None
        return (self.usage_chunk(output) if usage else b"") + SSE_DONE

    def usage_chunk(self, output: Output) -> bytes:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens)
        return sse(body)

    def body(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        logprobs: list[list[TokenInfo]] | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = 0,
        reasoning_open: bool = False,
    ) -> dict[str, Any]:
        """The whole non-streaming response (`reasoning_open`: as Output has it)."""
        self.reasoning_open = reasoning_open
        choices = [
            self._choice(i, text, finish_reasons[i], logprobs[i] if logprobs else None)
            for i, text in enumerate(texts)
        ]
        body = self._envelope(self.object, choices)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def _delta(self, choice: ChoiceOutput, first: bool, output: Output) -> dict[str, Any] | None:
        raise NotImplementedError

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _choice(
        self, index: int, text: str, finish: str | None, logprobs: list[TokenInfo] | None
    ) -> dict[str, Any]:
        raise NotImplementedError


class _ChoiceText:
    """How one chat choice's text splits: the think block into reasoning (with a
    reasoning parser), tool-call blocks into tool-call deltas (with tools), the rest into
    content."""

    def __init__(self, tools: ToolCalling | None, reasoning: ReasoningParser | None) -> None:
        self.reasoning = reasoning
        self.tools: ToolCallParser | None = tools.parser() if tools is not None else None
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
        content, deltas = self.tools.feed(content)
        if finish_reason is not None:
            rest, more_deltas = self.tools.close(truncated=finish_reason == "length")
            content, deltas = content + rest, merge_deltas(deltas + more_deltas)
        return reasoning, content, deltas

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.tools.calls if self.tools is not None else []

    def completed_calls(self) -> list[dict[str, Any]]:
        """The calls completed since the last time asked, whole (responses_format.py)."""
        done = self.tools.done if self.tools is not None else 0
        new, self._given = self.calls[self._given : done], done
        return new


class ChatFormat(_Format):
    """With tools, each choice's text goes through a ToolCallParser: its tool-call blocks
    become `tool_calls` (streamed as `delta.tool_calls`: a call's id and name once its
    block shows them, then its arguments piece by piece) and the rest stays content. With
    `reasoning` (--reasoning-parser), the think block ahead of them becomes
    `reasoning_content` (streamed as `delta.reasoning_content`)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def __init__(
        self,
        model: str,
        n_choices: int = 1,
        tools: ToolCalling | None = None,
        reasoning: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(model, n_choices, continuous_usage)
        self.tools = tools
        self.reasoning = reasoning
        self.reasoning_open = False  # the output starts inside the think block
        self._texts: dict[int, _ChoiceText] = {}  # per choice, while it streams

    def _choice_text(self, index: int) -> _ChoiceText:
        if index not in self._texts:
            parser = ReasoningParser(self.reasoning_open) if self.reasoning else None
            self._texts[index] = _ChoiceText(self.tools, parser)
        return self._texts[index]

    def _parse(self, choice: ChoiceOutput) -> tuple[str, list[dict[str, Any]]]:
        """The content of the choice's new text and the calls it completed, whole (for a
        format that sends each call at once: responses_format.py)."""
        parsed = self._choice_text(choice.index)
        _, content, _ = parsed.feed(choice.text, choice.finish_reason)
        return content, parsed.completed_calls()

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if self.tools is None:
            return reason
        return self.tools.finish_reason(reason, bool(self._choice_text(index).calls))

    def _delta(self, choice: ChoiceOutput, first: bool, output: Output) -> dict[str, Any] | None:
        self.reasoning_open = self.reasoning_open or output.reasoning_open
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        reasoning, content, calls = self._choice_text(choice.index).feed(
            choice.text, choice.finish_reason
        )
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not choice.logprobs:
            return None
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": _chat_logprobs(choice.logprobs) if choice.logprobs else None,
            "finish_reason": None,
        }

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        return {
            "index": choice.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": self._finish_reason(choice.index, choice.finish_reason),
        }

    def _choice(self, index: int, text: str, finish: str | None, logprobs) -> dict[str, Any]:
        self._texts.pop(index, None)
        parsed = self._choice_text(index)
        reasoning, content, _ = parsed.feed(text, finish or "stop")
        calls = parsed.calls
        # no text besides reasoning or calls (or none allowed besides calls): null content
        empty = None if calls or reasoning or (self.tools and self.tools.forced) else ""
        message: dict[str, Any] = {"role": "assistant", "content": content or empty}
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": self._finish_reason(index, finish),
        }


class CompletionFormat(_Format):
    object = "text_completion"
    chunk_object = "text_completion"  # OpenAI streams completions as the same object
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def _delta(self, choice: ChoiceOutput, first: bool, output: Output) -> dict[str, Any] | None:
        if not choice.text and not choice.logprobs:
            return None
        logprobs = _completion_logprobs(choice.logprobs) if choice.logprobs else None
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": None,
        }

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": "",
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }

    def _choice(self, index: int, text: str, finish: str | None, logprobs) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": finish,
        }


def _chat_logprobs(infos: list[TokenInfo]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": info.token,
                "logprob": info.logprob,
                "bytes": list(info.raw),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": list(raw)} for text, raw, lp in info.top
                ],
            }
            for info in infos
        ],
        "refusal": None,
    }


def _completion_token(text: str, raw: bytes) -> str:
    """A token that holds only part of a character is named by its bytes, as OpenAI does."""
    if "\ufffd" in text and raw:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _completion_logprobs(infos: list[TokenInfo]) -> dict[str, Any]:
    """OpenAI's shape: each token's alternatives always hold the token itself (so up to
    `logprobs` + 1 of them); the echoed prompt's first token has null for both."""
    top: list[dict[str, float] | None] = []
    for info in infos:
        if info.logprob is None:  # the prompt's first token: nothing predicts it
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for text, raw, lp in info.top:  # best first: a repeated name keeps its best value
            alternatives.setdefault(_completion_token(text, raw), lp)
        alternatives.setdefault(_completion_token(info.token, info.raw), info.logprob)
        top.append(alternatives)
    return {
        "tokens": [_completion_token(info.token, info.raw) for info in infos],
        "token_logprobs": [info.logprob for info in infos],
        "top_logprobs": top,
        "text_offset": [info.offset for info in infos],
    }
