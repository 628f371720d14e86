"""Messages into the tokenizer worker, from both of its neighbours.

From the API server: TokenizeMsg (creates the request's decode state), AbortMsg (removes
it and is forwarded to the scheduler), LifecycleQueryMsg.
From the scheduler: DetokenizeMsg (one sampled token; the last one carries finish_reason),
BackendErrorMsg (the request ended with an error; nothing more follows for its uid),
SchedulerStateMsg (the scheduler's answer to a state query).
"""

from __future__ import annotations

from typing import Any

import msgspec

from minisgl.core import SamplingParams


class TokenizeMsg(msgspec.Struct, tag=True):
    uid: int
    sampling_params: SamplingParams
    text: str | None = None  # a plain prompt
    messages: list[dict[str, Any]] | None = None  # a chat conversation: chat template
    input_ids_packed: bytes | None = None  # a prompt given as token ids (codec.pack_ids)


class AbortMsg(msgspec.Struct, tag=True):
    uid: int


class LifecycleQueryMsg(msgspec.Struct, tag=True):
    query_id: int


class DetokenizeMsg(msgspec.Struct, tag=True):
    uid: int
    next_token: int
    finish_reason: str | None = None  # "stop" or "length" on the last token, else None


class BackendErrorMsg(msgspec.Struct, tag=True):
    uid: int
    message: str
    status: int = 400  # the HTTP status the API server answers with
    code: str | None = None  # OpenAI error code, e.g. "context_length_exceeded"
    param: str | None = None


class SchedulerStateMsg(msgspec.Struct, tag=True):
    query_id: int
    state: dict[str, int]


TokenizerMsg = (
    TokenizeMsg | AbortMsg | LifecycleQueryMsg | DetokenizeMsg | BackendErrorMsg | SchedulerStateMsg
)
