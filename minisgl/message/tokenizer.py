"""Messages into the tokenizer worker, from both of its neighbours.

From the API server: TokenizeMsg (creates the request's decode state), AbortMsg (removes
it and is forwarded to the scheduler), LifecycleQueryMsg.
From the scheduler: DetokenizeMsg (one sampled token; the last one carries finish_reason;
choice 0's first carries the prompt logprobs when asked),
BackendErrorMsg (the request ended with an error; nothing more follows for its uid),
SchedulerStateMsg (the scheduler's answer to a state query, a SchedulerState: state.py).
(The channel's union, with the observers' batches, is the package's `TokenizerMsg`.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from minisgl.core import SamplingParams

from .errors import ErrorInfo
from .state import SchedulerState


class TokenizeMsg(msgspec.Struct, tag=True):
    uid: int
    sampling_params: SamplingParams
    text: str | None = None  # a plain prompt
    messages: list[dict[str, Any]] | None = None  # a chat conversation: chat template
    input_ids_packed: bytes | None = None  # a prompt given as token ids (codec.pack_ids)
    echo: bool = False  # the output starts with the prompt (completions' `echo`)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions for the chat template
    # how the chat template renders `messages` (vLLM's and SGLang's request fields)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message stays open for the model
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables
    # the --reasoning-parser of a chat request whose output may think: the worker tells
    # the API server when the prompt leaves the model inside the think block
    reasoning: str | None = None
    # who sent it (an API key's digest, else an address): the scheduler shares its turns
    # between clients (scheduler/prefill.py); the API server sets it from the request
    client: str = ""


class AbortMsg(msgspec.Struct, tag=True):
    uid: int


class LifecycleQueryMsg(msgspec.Struct, tag=True):
    query_id: int
    flush_cache: bool = False  # passed on to the scheduler (POST /debug/flush_cache)


class TokenLogprob(msgspec.Struct, array_like=True):
    """The sampled token's log-probability and the top alternatives (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]] = []


class DetokenizeMsg(msgspec.Struct, tag=True):
    uid: int
    next_token: int | None  # None: the choice ended with its prompt (max_tokens 0)
    finish_reason: str | None = None  # "stop" or "length" on the choice's last token
    index: int = 0  # which choice of the request
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # on a choice's first token: prompt tokens whose K/V came from the prefix cache
    cached_tokens: int = 0
    # on choice 0's first message, when asked (prompt_logprobs): prompt token p + 1's
    # logprob given tokens 0..p and the top alternatives, for p in 0..prompt_len - 2
    prompt_logprobs: list[TokenLogprob] | None = None


class BackendErrorMsg(msgspec.Struct, tag=True):
    uid: int
    error: ErrorInfo  # what went wrong, as a kind: the API server chooses the HTTP status


class SchedulerStateMsg(msgspec.Struct, tag=True):
    query_id: int
    state: SchedulerState
