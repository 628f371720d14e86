"""Typed messages, one module per receiving component, plus the codec they travel with."""

from __future__ import annotations

from .backend import AbortBackendMsg, BackendMsg, ExitMsg, StateQueryMsg, UserMsg
from .codec import Codec, pack_ids, unpack_ids
from .tokenizer import BackendErrorMsg, DetokenizeMsg, SchedulerStateMsg, TokenizerMsg

__all__ = [
    "AbortBackendMsg",
    "BackendErrorMsg",
    "BackendMsg",
    "Codec",
    "DetokenizeMsg",
    "ExitMsg",
    "SchedulerStateMsg",
    "StateQueryMsg",
    "TokenizerMsg",
    "UserMsg",
    "pack_ids",
    "unpack_ids",
]
