"""Helpers shared by the end-to-end tests: request bodies, raw HTTP over a socket, SSE parsing."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from minisgl.testing.server import RunningServer

SSE_DONE = b"data: [DONE]\n\n"
TOKEN_CHARS = 16_000  # text per token of the `long_token_dir` model (conftest.py)
ERROR_KEYS = {"message", "type", "param", "code"}


def start_server(model: Path | str | None, *args: str) -> RunningServer:
    # no thread settings here: the scheduler leaves cores to the other processes itself
    return RunningServer(None if model is None else str(model), *args)


def chat_body(model: str, content: str = "hi", **params: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **params}


def assert_error_body(body: dict, code: str | None = None) -> dict:
    """`body` is an OpenAI error body; returns its inner error object."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def split_sse(raw: bytes) -> list[bytes]:
    """The payloads of a complete SSE body; every event must be exactly `data: …\\n\\n`."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    events = raw[:-2].split(b"\n\n")
    payloads = []
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event[:200]
        payloads.append(event[len(b"data: ") :])
    return payloads


def prompt_len(model_dir: Path | str, messages: list[dict[str, str]]) -> int:
    """Token count of `messages` rendered by the model's chat template, as a client would
    count it with the Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def raw_post(
    port: int,
    path: str,
    body: dict[str, Any],
    rcvbuf: int | None = None,
    headers: dict[str, str] | None = None,
) -> socket.socket:
    """Send one HTTP/1.1 POST over a fresh socket and return the socket, unread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the advertised window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        + "Connection: close\r\n\r\n"  # the server closes once the response is complete
    ).encode()
    sock.sendall(head + data)
    return sock


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a raw chunked HTTP response, and whether its terminating chunk arrived
    (False: the connection was cut before the response was complete)."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep and b"transfer-encoding: chunked" in head.lower(), head[:500]
    body = bytearray()
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return bytes(body), False
        size = int(size_line, 16)
        if size == 0:
            return bytes(body), True
        if len(rest) < size + 2:
            body += rest[:size]
            return bytes(body), False
        body += rest[:size]
        rest = rest[size + 2 :]


def scrape_metrics(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics, parsed: {(sample name, sorted label pairs): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base_url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples
