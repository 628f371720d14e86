"""Messages into the tokenizer worker.

From the API server: TokenizeMsg (creates the request's decode state), AbortMsg.
From the scheduler: DetokenizeMsg (one sampled token, the last one carries finish_reason),
BackendErrorMsg (the request ended with an error; no more messages follow for its uid),
SchedulerStateMsg (the answer to a StateQueryMsg).
"""

from __future__ import annotations

import msgspec


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


TokenizerMsg = DetokenizeMsg | BackendErrorMsg | SchedulerStateMsg
