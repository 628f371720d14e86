"""The OpenAI wire format: request models in, response bodies and SSE chunks out.

Contract: request models are strict (a wrong type is a 400, not a silent coercion) and
forbid unknown fields (a parameter we do not implement is refused by name, never ignored).
The builders produce exactly what the official `openai` client's types expect:
`chat.completion` and `chat.completion.chunk` objects with `chatcmpl-` ids, `created`,
`model`, and `usage` with real counts.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from minisgl.core import SamplingParams
from minisgl.message import ErrorInfo


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; chat templates know "system"
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


# --8<-- [start:request_model]
class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # extension, as in vLLM and SGLang
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False  # extension: keep generating past the end-of-sequence token
    user: str | None = None  # an end-user id for logs; it changes no output

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


# --8<-- [end:request_model]


# ---------------------------------------------------------------------- responses
_json = msgspec.json.Encoder()


def new_chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def error_body(error: ErrorInfo) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: ...` and the blank line that ends it."""
    if isinstance(payload, str):
        return b"data: " + payload.encode() + b"\n\n"
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ChatFormat:
    """Builds the bodies of one chat completion: its id, creation time and model name."""

    def __init__(self, model: str) -> None:
        self.id = new_chat_id()
        self.created = int(time.time())
        self.model = model

    def _chunk(self, delta: dict[str, str], finish_reason: str | None) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
        )

    # --8<-- [start:stream_chunks]
    def stream_chunks(
        self, text: str, first: bool, finish_reason: str | None, error: ErrorInfo | None
    ) -> bytes:
        """The SSE bytes for one coalesced output."""
        out = b""
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if delta:
            out += self._chunk(delta, None)
        if error is not None:  # after the first byte an error can only be an event
            out += sse(error_body(error))
        elif finish_reason is not None:
            out += self._chunk({}, finish_reason)
        return out

    # --8<-- [end:stream_chunks]

    def completion(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage(prompt_tokens, completion_tokens),
        }
