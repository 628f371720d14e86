"""The API server alone turns an error kind into an HTTP answer: every kind has one, a
prompt error names the prompt field of the endpoint it happened on, and server states
that pass (overloaded, shutting down) say when to retry."""

from __future__ import annotations

import json

import pytest

from minisgl.message import ErrorInfo, ErrorKind
from minisgl.server.chat import ChatFormat
from minisgl.server.completions import CompletionFormat
from minisgl.server.errors import HttpError, error_code, to_http


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_kind_has_an_openai_shaped_answer(kind):
    answer = to_http(ErrorInfo(kind, "what happened"))
    assert answer.status in (400, 500, 503)
    assert answer.type == ("invalid_request_error" if answer.status == 400 else "server_error")
    assert answer.code == error_code(ErrorInfo(kind, "x"))
    body = answer.body()
    assert body == {
        "error": {
            "message": "what happened",
            "type": answer.type,
            "param": answer.param,
            "code": answer.code,
        }
    }


@pytest.mark.parametrize(
    "kind",
    [
        ErrorKind.EMPTY_PROMPT,
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        ErrorKind.INVALID_PROMPT,
        ErrorKind.INVALID_TOKEN_ID,
    ],
)
def test_a_prompt_error_names_the_endpoints_prompt_field(kind):
    error = ErrorInfo(kind, "bad prompt")
    chat, completion = ChatFormat("m").error(error), CompletionFormat("m").error(error)
    assert (chat.status, chat.param) == (400, "messages")
    assert (completion.status, completion.param) == (400, "prompt")


def test_a_field_named_by_the_worker_wins_over_the_prompt_field():
    error = ErrorInfo(ErrorKind.INVALID_TOKEN_ID, "bad id", field="logit_bias")
    assert ChatFormat("m").error(error).param == "logit_bias"
    sampling = ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, "top_p must be in (0, 1]", "top_p")
    assert CompletionFormat("m").error(sampling).param == "top_p"


def test_context_length_keeps_its_openai_code():
    answer = to_http(ErrorInfo(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "too long"), "messages")
    assert (answer.status, answer.code, answer.param) == (
        400,
        "context_length_exceeded",
        "messages",
    )


@pytest.mark.parametrize(
    ("kind", "retry_after"),
    [
        (ErrorKind.OVERLOADED, "1"),
        (ErrorKind.SHUTTING_DOWN, "5"),
        (ErrorKind.BACKEND_UNAVAILABLE, None),
        (ErrorKind.SLOW_CLIENT, None),
    ],
)
def test_passing_server_states_say_when_to_retry(kind, retry_after):
    response = to_http(ErrorInfo(kind, "busy")).response()
    assert response.status_code == 503
    assert response.headers.get("retry-after") == retry_after
    assert response.headers["content-type"] == "application/json"
    assert json.loads(response.body)["error"]["code"] == kind.value


def test_an_http_error_response_keeps_extra_headers():
    response = HttpError(401, "no key", code="invalid_api_key").response({"WWW-Authenticate": "B"})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "B"
    assert json.loads(response.body)["error"]["type"] == "invalid_request_error"
