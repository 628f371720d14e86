"""How a request failed, as the workers and the frontend say it: a kind and a message.

Contract: the scheduler, the tokenizer worker and the API server's FrontendManager end a
request with an `ErrorInfo` whose `kind` says what went wrong in the terms of the request
(its prompt is too long, a sampling value is out of range, the server is shutting down …),
never in HTTP terms. The API server alone turns a kind into an HTTP status and an OpenAI
error body (minisgl/server/errors.py), because only it knows the endpoint: the same
over-long prompt is the `messages` parameter on /v1/chat/completions and the `prompt`
parameter on /v1/completions.
"""

from __future__ import annotations

import enum

import msgspec


class ErrorKind(enum.Enum):
    # the request's fault
    EMPTY_PROMPT = "empty_prompt"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # no room left to generate
    INVALID_PROMPT = "invalid_prompt"  # the chat template or the tokenizer refused it
    INVALID_TOKEN_ID = "invalid_token_id"  # outside the vocabulary; `field` names where
    INVALID_SAMPLING_VALUE = "invalid_sampling_value"  # `field` names the parameter
    UNENCODABLE_REQUEST = "unencodable_request"  # e.g. a lone surrogate in the text
    RESPONSE_TOO_LARGE = "response_too_large"  # a whole (non-streamed) answer past the cap
    # the server's state
    OVERLOADED = "overloaded"  # too many requests in flight; retry shortly
    SHUTTING_DOWN = "shutting_down"
    SLOW_CLIENT = "slow_client"  # the client did not read its output in time
    BACKEND_UNAVAILABLE = "backend_unavailable"  # a worker process is gone
    INTERNAL = "internal"  # a bug: the request cannot be completed


class ErrorInfo(msgspec.Struct):
    kind: ErrorKind
    message: str  # for a person: what went wrong and, where it helps, what to do
    field: str | None = None  # the request field at fault, where the kind has one
