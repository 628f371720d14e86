"""Messages into the API server (sent by the tokenizer worker).

UserReply carries one step's new text for one uid, with running token counts; the last
reply of a request has `finished` set and either a finish_reason or an error. At most one
terminal reply is sent per uid. LifecycleStateMsg answers a LifecycleQueryMsg with the
tokenizer's and the scheduler's live per-uid state.
"""

from __future__ import annotations

import msgspec


class ErrorInfo(msgspec.Struct):
    message: str
    status: int = 400
    code: str | None = None
    param: str | None = None
    type: str = "invalid_request_error"


class UserReply(msgspec.Struct, tag=True):
    uid: int
    incremental_output: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" or "length" when finished without error
    error: ErrorInfo | None = None  # set when the request ended with an error
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far, this reply's included


class LifecycleStateMsg(msgspec.Struct, tag=True):
    query_id: int
    tokenizer: dict[str, int]
    scheduler: dict[str, int]


FrontendMsg = UserReply | LifecycleStateMsg
