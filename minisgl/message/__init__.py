"""Typed messages, one module per receiving component (the codec they travel with is
utils/codec.py, re-exported here).

API server --TokenizeMsg, AbortMsg, LifecycleQueryMsg--> tokenizer worker
tokenizer worker --UserMsg, AbortBackendMsg, StateQueryMsg--> scheduler
scheduler --DetokenizeMsg, BackendErrorMsg, SchedulerStateMsg, TimelineMsg--> tokenizer worker
tokenizer worker --UserReply, LifecycleStateMsg, TimelineMsg--> API server

The scheduler's answer to a state query is a typed `SchedulerState` (state.py).
A request that fails ends with an `ErrorInfo` (errors.py): a kind and a message, never an
HTTP status; the API server maps the kind to its answer.
"""

from __future__ import annotations

from minisgl.utils.codec import Codec, pack_ids, unpack_ids

from .backend import AbortBackendMsg, BackendMsg, StateQueryMsg, UserMsg
from .errors import ErrorInfo, ErrorKind
from .frontend import FrontendMsg, LifecycleStateMsg, TokenInfo, UserReply
from .state import RankState, SchedulerCounts, SchedulerState
from .timeline import END_EVENTS, End, TimelineEvent, TimelineMsg
from .tokenizer import (
    AbortMsg,
    BackendErrorMsg,
    DetokenizeMsg,
    LifecycleQueryMsg,
    SchedulerStateMsg,
    TokenizeMsg,
    TokenizerMsg,
    TokenLogprob,
)

__all__ = [
    "AbortBackendMsg",
    "AbortMsg",
    "BackendErrorMsg",
    "BackendMsg",
    "Codec",
    "DetokenizeMsg",
    "ErrorInfo",
    "ErrorKind",
    "FrontendMsg",
    "LifecycleQueryMsg",
    "LifecycleStateMsg",
    "RankState",
    "SchedulerCounts",
    "SchedulerState",
    "SchedulerStateMsg",
    "END_EVENTS",
    "End",
    "TimelineEvent",
    "TimelineMsg",
    "StateQueryMsg",
    "TokenizeMsg",
    "TokenInfo",
    "TokenizerMsg",
    "TokenLogprob",
    "UserMsg",
    "UserReply",
    "pack_ids",
    "unpack_ids",
]
