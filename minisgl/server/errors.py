"""Every error answer of the API server: one place that speaks HTTP about failures.

Contract:
- `HttpError` is an answer: status, the OpenAI error body's `message`, `type`, `code` and
  `param`, and a `Retry-After` where waiting helps. `.body()` is the JSON object
  `{"error": {"message", "type", "param", "code"}}`; `.response()` the whole HTTP answer,
  usable as a FastAPI return value and as a plain ASGI callable (middleware).
- `to_http(error, prompt_param)` maps an `ErrorInfo` (a kind and a message, as the workers
  and the FrontendManager say it) to its answer. Only here do kinds get statuses; the
  endpoint names its prompt field (`messages` for chat, `prompt` for completions), so a
  prompt-shaped error names the parameter the client actually sent.
- `RequestFailed` carries an `ErrorInfo` out of the frontend (a request refused at
  admission, a dead backend) to whoever answers the client.
- `from_status(status, message)` is the answer to an HTTP-level refusal (Starlette's
  HTTPException: no route, a wrong method, a body too large, bodies over their budget),
  its code chosen by its status; the app's handler and the body-limit middleware share it.
- `json_response` is the one writer of JSON bodies (msgspec-encoded), errors or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from minisgl.message import ErrorInfo, ErrorKind

_json = msgspec.json.Encoder()

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class RequestFailed(Exception):
    """A request that cannot be served, or can no longer be; `error` says why."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(error.message)
        self.error = error


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status, headers, media_type="application/json")


@dataclass(frozen=True)
class HttpError:
    status: int
    message: str
    type: str = INVALID_REQUEST
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None  # seconds, sent as Retry-After

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> Response:
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return json_response(self.status, self.body(), headers)


@dataclass(frozen=True)
class _Answer:
    status: int
    type: str
    code: str | None
    about_prompt: bool = False  # the error names the endpoint's prompt parameter
    retry_after: int | None = None


# --8<-- [start:error_kinds]
_ANSWERS: dict[ErrorKind, _Answer] = {
    ErrorKind.EMPTY_PROMPT: _Answer(400, INVALID_REQUEST, None, about_prompt=True),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: _Answer(
        400, INVALID_REQUEST, "context_length_exceeded", about_prompt=True
    ),
    ErrorKind.INVALID_PROMPT: _Answer(400, INVALID_REQUEST, None, about_prompt=True),
    ErrorKind.INVALID_TOKEN_ID: _Answer(400, INVALID_REQUEST, None, about_prompt=True),
    ErrorKind.INVALID_SAMPLING_VALUE: _Answer(400, INVALID_REQUEST, "invalid_value"),
    ErrorKind.UNENCODABLE_REQUEST: _Answer(400, INVALID_REQUEST, "invalid_value"),
    ErrorKind.RESPONSE_TOO_LARGE: _Answer(400, INVALID_REQUEST, "response_too_large"),
    ErrorKind.OVERLOADED: _Answer(503, SERVER_ERROR, "overloaded", retry_after=1),
    ErrorKind.SHUTTING_DOWN: _Answer(503, SERVER_ERROR, "shutting_down", retry_after=5),
    ErrorKind.SLOW_CLIENT: _Answer(503, SERVER_ERROR, "slow_client"),
    ErrorKind.BACKEND_UNAVAILABLE: _Answer(503, SERVER_ERROR, "backend_unavailable"),
    ErrorKind.INTERNAL: _Answer(500, SERVER_ERROR, "internal_error"),
}


_STATUS_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    503: "overloaded",
}


def from_status(status: int, message: str) -> HttpError:
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    return HttpError(status, message, kind, _STATUS_CODES.get(status))


def to_http(error: ErrorInfo, prompt_param: str | None = None) -> HttpError:
    """The answer to `error` on an endpoint whose prompt field is `prompt_param`."""
    answer = _ANSWERS[error.kind]
    param = error.field or (prompt_param if answer.about_prompt else None)
    return HttpError(
        answer.status, error.message, answer.type, answer.code, param, answer.retry_after
    )


# --8<-- [end:error_kinds]


def error_code(error: ErrorInfo) -> str | None:
    """The OpenAI error code a client sees for `error` (metrics count by it)."""
    return _ANSWERS[error.kind].code


def unavailable(message: str) -> ErrorInfo:
    """Nothing can be served: a worker is gone or does not answer."""
    return ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, message)
