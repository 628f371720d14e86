"""Messages into the API server (sent by the tokenizer worker).

UserReply carries one step's new text for one choice of one uid, with running token counts;
the last reply of a choice has its finish_reason, the last reply of the request (every choice
done, or an error) has `finished` set. At most one terminal reply is sent per uid.
LifecycleStateMsg answers a LifecycleQueryMsg with the tokenizer's and the scheduler's live
per-uid state (the scheduler's typed: state.py).
"""

from __future__ import annotations

import msgspec

from .errors import ErrorInfo
from .state import SchedulerState


class TokenInfo(msgspec.Struct, array_like=True):
    """One sampled (or prompt) token for logprobs: its text (U+FFFD where it holds only
    part of a character), its exact bytes, its log-probability (None for the prompt's first
    token, which nothing predicts), where its text starts in the choice's output, and the
    top alternatives as (text, bytes, logprob)."""

    token: str
    raw: bytes
    logprob: float | None
    offset: int = 0
    top: list[tuple[str, bytes, float]] = []


# --8<-- [start:user_reply]
class UserReply(msgspec.Struct, tag=True):
    uid: int
    incremental_output: str = ""
    finished: bool = False  # the request's terminal reply: no more for this uid
    finish_reason: str | None = None  # "stop" or "length": this choice has ended
    error: ErrorInfo | None = None  # set when the request ended with an error
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens of this choice so far, this reply's included
    index: int = 0  # which choice
    logprobs: list[TokenInfo] | None = None  # for the tokens whose text this reply carries
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage)
    # on a choice's first reply, when asked (echo with logprobs): one per prompt token
    prompt_logprobs: list[TokenInfo] | None = None
    # sent once, before any output, when the prompt ends inside an open `<think>` block:
    # the output starts as reasoning (--reasoning-parser)
    reasoning_open: bool = False


# --8<-- [end:user_reply]


class LifecycleStateMsg(msgspec.Struct, tag=True):
    query_id: int
    tokenizer: dict[str, int]
    scheduler: SchedulerState
