"""Response bodies in the OpenAI wire format, for chat and for plain completions.

Contract: a format object is made per HTTP request (it holds the id, creation time, model
name and what was already sent) and turns the frontend's coalesced `Output`s into
- `chunks(output)`: the SSE bytes of one output (a choice's first chunk carries
  role "assistant" in chat; a choice that ended gets a chunk with its finish_reason; an
  error after streaming began is one `data: {"error": ...}` event),
- `closing(output, include_usage)`: what ends the stream: the usage chunk asked for by
  `stream_options.include_usage`, then `data: [DONE]`,
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
from .tools import ToolCalling, ToolCallParser

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event: `data: ...` and the blank line that ends it."""
    return b"data: " + _json.encode(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # as OpenAI reports it: prompt tokens whose computation was reused
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class _Format:
    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str  # the request field that holds the prompt, named by prompt errors

    def __init__(self, model: str, n_choices: int = 1) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n_choices = n_choices
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
            delta = self._delta(choice, first)
            if delta is not None:
                out += sse(self._envelope(self.chunk_object, [delta]))
            if choice.finish_reason is not None and output.error is None:
                out += sse(self._envelope(self.chunk_object, [self._end(choice)]))
        if output.error is not None:  # after the first byte an error can only be an event
            out += sse(self.error(output.error).body())
        return out

    # --8<-- [end:chunks]

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
        cached_tokens: int = 0,
    ) -> dict[str, Any]:
        """The whole non-streaming response."""
        choices = [
            self._choice(i, text, finish_reasons[i], logprobs[i] if logprobs else None)
            for i, text in enumerate(texts)
        ]
        body = self._envelope(self.object, choices)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def _delta(self, choice: ChoiceOutput, first: bool) -> dict[str, Any] | None:
        raise NotImplementedError

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _choice(
        self, index: int, text: str, finish: str | None, logprobs: list[TokenInfo] | None
    ) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(_Format):
    """With tools, each choice's text goes through a ToolCallParser: its tool-call blocks
    become `tool_calls` (streamed as `delta.tool_calls`, one entry per call once its block
    has closed) and the rest stays content."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def __init__(self, model: str, n_choices: int = 1, tools: ToolCalling | None = None) -> None:
        super().__init__(model, n_choices)
        self.tools = tools
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, while it streams

    def _parse(self, choice: ChoiceOutput) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool calls in this piece of the choice's text."""
        if self.tools is None:
            return choice.text, []
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = self.tools.parser()
        content, calls = parser.feed(choice.text)
        if choice.finish_reason is not None:  # nothing more comes: flush what was held
            content += parser.close()
        return content, calls

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if self.tools is None:
            return reason
        parser = self._parsers.get(index)
        return self.tools.finish_reason(reason, bool(parser and parser.calls))

    def _delta(self, choice: ChoiceOutput, first: bool) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        content, calls = self._parse(choice)
        if content:
            delta["content"] = content
        if calls:
            start = len(self._parsers[choice.index].calls) - len(calls)
            delta["tool_calls"] = [{"index": start + i, **c} for i, c in enumerate(calls)]
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
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            parser = self._parsers[index] = self.tools.parser()
            content, calls = parser.feed(text)
            content += parser.close()
            message["content"] = content if content or not calls else None
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

    def _delta(self, choice: ChoiceOutput, first: bool) -> dict[str, Any] | None:
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
