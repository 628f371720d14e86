"""Response bodies in the OpenAI wire format: what every endpoint's format shares.

Contract: a format object (chat.py's `ChatFormat`, completions.py's `CompletionFormat`, the
Responses API's) is made per HTTP request (its id, creation time, model, what was sent)
and turns the frontend's coalesced `Output`s into `chunks(output)`, the SSE bytes of one
output (an error after streaming began is one `data: {"error": ...}` event); `closing
(output, include_usage)`, what ends the stream (the usage chunk when asked, then `data:
[DONE]`; with `continuous_usage` every chunk carries the usage so far); `body(...)`, the
whole non-streaming response; and `error(error_info)`, the HTTP error answer on this
endpoint. A subclass says what a choice's delta, end chunk and whole body look like.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import msgspec

from minisgl.message import ErrorInfo, TokenInfo

from .buffer import ChoiceOutput, Output
from .errors import HttpError, to_http

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


class OutputFormat:
    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str  # the request field that holds the prompt, named by prompt errors
    renamed: dict[str, str] = {}  # fields the workers name otherwise than this request did

    def __init__(self, model: str, n_choices: int = 1, continuous_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n_choices = n_choices
        self.continuous_usage = continuous_usage
        self._started: set[int] = set()  # choices whose first chunk went out

    def error(self, error: ErrorInfo) -> HttpError:
        """The answer to a failed request on this endpoint."""
        answer = to_http(error, self.prompt_param)
        return replace(answer, param=self.renamed.get(answer.param, answer.param))

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
