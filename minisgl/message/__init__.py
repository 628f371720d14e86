"""Typed messages, one module per receiving component (the codec they travel with is
utils/codec.py, re-exported here), and the union each channel carries.

API server --TokenizeMsg, AbortMsg, LifecycleQueryMsg--> tokenizer worker
tokenizer worker --UserMsg, AbortBackendMsg, StateQueryMsg--> scheduler
scheduler --DetokenizeMsg, BackendErrorMsg, SchedulerStateMsg--> tokenizer worker
tokenizer worker --UserReply, LifecycleStateMsg--> API server
The unions below are the core's; on the wire a channel also carries what the observers
send on (the timeline batches, minisgl/timeline/), which each component hands to its own.

The scheduler's answer to a state query is a typed `SchedulerState` (state.py).
A request that fails ends with an `ErrorInfo` (errors.py): a kind and a message, never an
HTTP status; the API server maps the kind to its answer.
"""

from __future__ import annotations

from minisgl.utils.codec import Codec, pack_ids, unpack_ids

from .backend import AbortBackendMsg, BackendMsg, StateQueryMsg, UserMsg
from .errors import ErrorInfo, ErrorKind
from .frontend import LifecycleStateMsg, TokenInfo, UserReply
from .state import Lifecycle, RankState, SchedulerCounts, SchedulerState
from .tokenizer import (
    AbortMsg,
    BackendErrorMsg,
    DetokenizeMsg,
    LifecycleQueryMsg,
    SchedulerStateMsg,
    TokenizeMsg,
    TokenLogprob,
)

# what each channel carries of the core's messages
TokenizerMsg = (
    TokenizeMsg | AbortMsg | LifecycleQueryMsg | DetokenizeMsg | BackendErrorMsg | SchedulerStateMsg
)
FrontendMsg = UserReply | LifecycleStateMsg

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
    "Lifecycle",
    "LifecycleQueryMsg",
    "LifecycleStateMsg",
    "RankState",
    "SchedulerCounts",
    "SchedulerState",
    "SchedulerStateMsg",
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
