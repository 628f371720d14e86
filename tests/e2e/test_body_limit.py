"""The request body limit on the real server (tiny Llama, --max-body-bytes 64 KiB): a body
of exactly the limit is served and one byte more is 413 body_too_large, whether its length
is declared or it comes chunked; a 413 keeps the client's X-Request-Id, is counted in
/metrics as an error, and /debug/lifecycle ends at zero."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import (
    LIMITS_SERVER,
    MAX_BODY,
    assert_error_body,
    changed,
    chat_url,
    request_counts,
    scrape_metrics,
    tokens_body,
)

pytestmark = pytest.mark.server(LIMITS_SERVER)


def _padded(body: dict, size: int) -> bytes:
    """`body` as JSON, padded with insignificant whitespace to exactly `size` bytes."""
    data = json.dumps(body).encode()
    assert len(data) < size
    return data[:-1] + b" " * (size - len(data)) + b"}"


def _chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _post(http: httpx.Client, server, content, request_id: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return http.post(chat_url(server), content=content, headers=headers)


def test_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(server):
    body = tokens_body(server, 4)
    with httpx.Client(timeout=30) as http:
        ok = _post(http, server, _padded(body, MAX_BODY))
        assert ok.status_code == 200, ok.text
        over = _post(http, server, _padded(body, MAX_BODY + 1), "too-big-1")
    assert over.status_code == 413, over.text
    assert_error_body(over.json(), "body_too_large")
    assert over.headers["x-request-id"] == "too-big-1"
    server.wait_zero(1.0)


def test_chunked_body_over_the_limit_is_413_and_under_it_is_served(server):
    body = tokens_body(server, 4)
    with httpx.Client(timeout=30) as http:
        # a generator has no length: httpx sends it with Transfer-Encoding: chunked
        ok = _post(http, server, _chunks(_padded(body, MAX_BODY - 100), 4096))
        assert ok.request.headers.get("transfer-encoding") == "chunked"
        assert ok.status_code == 200, ok.text
        over = _post(
            http,
            server,
            _chunks(_padded(body, MAX_BODY + 16 * 1024)),
            "too-big-chunked",
        )
    assert over.request.headers.get("transfer-encoding") == "chunked"
    assert over.status_code == 413, over.text
    assert_error_body(over.json(), "body_too_large")
    assert over.headers["x-request-id"] == "too-big-chunked"
    server.wait_zero(1.0)


def test_413_answers_are_counted_as_errors(server):
    """Refused before any route ran, with a declared length or a chunked body alike: each
    is one request that ended with the error body_too_large."""
    body = tokens_body(server, 4)
    before = scrape_metrics(server)
    with httpx.Client(timeout=30) as http:
        for content in (_padded(body, MAX_BODY + 1), _chunks(_padded(body, MAX_BODY + 16384))):
            r = _post(http, server, content)
            assert r.status_code == 413
    after = scrape_metrics(server)
    assert changed(request_counts(after), request_counts(before)) == {
        ("error", "body_too_large"): 2
    }
