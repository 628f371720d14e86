"""Connections that never finish their request (slowloris) on the real server (tiny Llama,
a 2-second request read timeout, at most 40 connections): a hundred of them (half a
request line, headers without their end, a body shorter than declared, a chunked body that
never ends) do not keep a prompt client from being served, /health answers, and the slow
ones are closed: the oldest as soon as the cap needs room, the rest by the timeout, and so
is a second request on a kept-alive connection that never ends; a body in 1-byte chunks is
refused, and so is a body that would take the bodies held at once past their budget. A
request sent slowly but within the timeout is served; a client that half-closes its
connection after sending is a disconnect (its timeline says so)."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from e2e_helpers import ServerSpec, chat_url, tokens_body

READ_TIMEOUT_S = 2.0
CAP = 40
MAX_BODY, MAX_BODIES = 64 << 10, 128 << 10
pytestmark = pytest.mark.server(
    ServerSpec(
        "llama",
        (
            "--request-read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(CAP),
            "--max-body-bytes", str(MAX_BODY), "--max-body-bytes-total", str(MAX_BODIES),
        ),
    )
)  # fmt: skip

PARTIAL = [
    b"POST /v1/chat/comp",  # half a request line
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
    b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"mo',
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'5\r\n{"mod\r\n',
]


def _slow(port: int, i: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(PARTIAL[i % len(PARTIAL)])
    return s


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True  # the server closed it (a 503 or nothing, then EOF)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_slow_connections_neither_lock_out_others_nor_stay_open(server):
    slow = [_slow(server.port, i) for i in range(100)]
    try:
        start = time.monotonic()
        r = httpx.post(chat_url(server), json=tokens_body(server, 3), timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - start < READ_TIMEOUT_S  # served at once, not after timeouts
        # the first ones made room for the later ones (the cap), the rest time out
        assert _closed_by_server(slow[0], 1.0)
        assert all(_closed_by_server(s, READ_TIMEOUT_S + 2.0) for s in slow)
        assert time.monotonic() - start < READ_TIMEOUT_S + 4.0
    finally:
        for s in slow:
            s.close()
    server.wait_zero(2.0)


def test_a_request_sent_slowly_but_within_the_timeout_is_served(server):
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 2}' % server.model_name.encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        for piece in (head[:20], head[20:], body[:10], body[10:]):
            s.sendall(piece)
            time.sleep(READ_TIMEOUT_S / 8)
        s.settimeout(10)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_the_read_timeout_holds_for_every_request_of_a_kept_alive_connection(server):
    """Finding 6 of the round-4 review: a second request on a kept-alive connection that
    drips its headers or body forever is closed by the timeout like the first."""
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 2}' % server.model_name.encode()
    whole = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    for partial in PARTIAL:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(whole)  # the first request, served; the connection stays open
            s.settimeout(10)
            answer = b""
            while b'"usage"' not in answer:
                answer += s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            s.sendall(partial)  # the second request never ends
            start = time.monotonic()
            assert _closed_by_server(s, READ_TIMEOUT_S + 3.0), partial
            assert time.monotonic() - start < READ_TIMEOUT_S + 3.0
    server.wait_zero(2.0)


def _chunked(server, piece: int) -> bytes:
    """A completions request whose body goes as HTTP chunks of `piece` bytes, and its answer."""
    user = b"u" * 3000  # an end-user id changes no output: bulk that costs no tokens
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 2, "user": "%s"}' % (
        server.model_name.encode(),
        user,
    )
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece])
        for i in range(0, len(body), piece)
    )
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        try:
            s.sendall(head + chunks + b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the rest was sent
        s.settimeout(10)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


def test_a_body_in_tiny_chunks_is_refused_and_one_in_larger_chunks_served(server):
    """Finding 4 of the round-4 review: a body sent as 1-byte chunks cost the API server a
    parser event per byte; past TINY_PIECES such pieces it is a 400, and the connection
    closes. The same body in 1 KB chunks is served."""
    answer = _chunked(server, 1)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_too_fragmented" and "pieces" in error["message"]
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    answer = _chunked(server, 1024)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    server.wait_zero(2.0)


def _padded_body(server, size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (the padding is the end-user id)."""
    head = b'{"model": "%s", "prompt": [5, 6], "max_tokens": 1, "user": "' % (
        server.model_name.encode()
    )
    return head + b"u" * (size - len(head) - 2) + b'"}'


def _answer(s: socket.socket) -> bytes:
    """One whole HTTP answer (with a Content-Length) read from `s`."""
    s.settimeout(10)
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := s.recv(65536)):
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    (length,) = re.findall(rb"(?i)content-length: (\d+)", head)
    while len(body) < int(length) and (chunk := s.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


def test_bodies_held_at_once_have_a_budget_past_which_a_request_waits(server):
    """Finding 6 of the round-4 review: a hundred connections each holding a body just under
    the limit took the API server's memory up by 400 MB. Bodies held at once have a budget
    (--max-body-bytes-total): the body that crosses it is a 503 with Retry-After; the
    others are served, and once they are, the budget is whole again."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n"
    )
    bodies = [_padded_body(server, 60_000) for _ in range(2)]
    holding = [socket.create_connection(("127.0.0.1", server.port)) for _ in bodies]
    for s, body in zip(holding, bodies):
        s.sendall(head % len(body) + body[:-10])  # all but the last bytes: held
    time.sleep(0.3)  # the route has read what came
    try:
        third = _padded_body(server, 40_000)
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head % len(third) + third)
            answer = _answer(s)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"retry-after: 1" in answer.lower()
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "overloaded" and str(MAX_BODIES) in error["message"]
        for s, body in zip(holding, bodies):
            s.sendall(body[-10:])
            assert _answer(s).startswith(b"HTTP/1.1 200")
    finally:
        for s in holding:
            s.close()
    url, json_type = server.base_url + "/v1/completions", {"content-type": "application/json"}
    r = httpx.post(url, content=third, headers=json_type, timeout=30)
    assert r.status_code == 200, r.text  # the budget is whole again
    server.wait_zero(2.0)


def test_a_half_closed_client_is_a_disconnect(server):
    """A client that sends its request and then shuts its write side gets no answer: the
    server sees the end of its stream as the client leaving, and aborts the request."""
    body = tokens_body(server, 200, stream=True)
    data = httpx.Request("POST", chat_url(server), json=body).content
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: half-closed\r\nContent-Length: %d\r\n\r\n" % len(data)
    )
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + data)
        s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 5
        while True:  # its timeline says how it ended
            ended = httpx.get(server.base_url + "/debug/requests").json()["ended"]
            found = [t for t in ended if t["request_id"] == "half-closed"]
            if found:
                break
            assert time.monotonic() < deadline
            time.sleep(0.1)
    end = [e for e in found[0]["events"] if e["process"] == "api"][-1]
    assert (end["event"], end.get("by")) == ("aborted", "client_disconnect")
    assert found[0]["output_tokens"] < 200
    server.wait_zero(3.0)
