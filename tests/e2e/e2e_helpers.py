"""Helpers shared by the end-to-end tests: how a module names its server (`ServerSpec`) and
the servers several modules share, request bodies, streams held open, raw HTTP over a
socket, waiting on /debug/lifecycle, Prometheus samples, IPC directories."""

from __future__ import annotations

import json
import re
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from minisgl.testing.server import RunningServer
from minisgl.testing.sse import sse_chunks, sse_payloads

CHAT_PATH = "/v1/chat/completions"
SSE_DONE = b"data: [DONE]\n\n"
TOKEN_CHARS = 16_000  # text per token of the `long_token_dir` model (conftest.py)
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- servers
@dataclass(frozen=True)
class ServerSpec:
    """The server a module (or a test) runs against, named with
    `pytest.mark.server(ServerSpec(...))` and handed to it as the `server` fixture.

    `model`: a tiny architecture of the session's checkpoints ("llama", "qwen3"), the name
    of a checkpoint fixture of conftest.py ("long_context_dir", …), or None for the embedded
    default model. `args`: extra command-line flags. `shared`: one server for every module
    that names this spec; otherwise each module gets a server of its own."""

    model: str | None
    args: tuple[str, ...] = ()
    shared: bool = False


# the embedded default model (SmolLM2-135M-Instruct, real weights), one server for the
# modules that need a model that answers sensibly (test_default_model_server.py,
# test_agents_e2e.py, test_clients_e2e.py, test_client_envs_e2e.py)
DEFAULT_MODEL_SERVER = ServerSpec(None, shared=True)

# test_protocol_*.py: the tiny Llama with a 2048-token context (a long generation stays in
# flight for seconds) and 4-token KV pages (page sharing between the n choices of a request
# is visible in page counts)
PROTOCOL_SERVER = ServerSpec(
    "long_context_dir", ("--max-seq-len", "2048", "--page-size", "4"), shared=True
)

# The operations tests (admission, body limit, request ids, metrics, drain): the tiny Llama
# with a 32k-token context, where a stream of ENDLESS tokens takes minutes, so it stays in
# flight until the test closes it (or the server ends it); at most two requests at once
# and a 64 KiB body limit.
CONTEXT_32K = 32768
ENDLESS = 30_000  # tokens: minutes of decoding, never finishes within a test
MAX_BODY = 65536
LIMITS_SERVER = ServerSpec(
    "context_32k_dir",
    (
        "--max-seq-len",
        str(CONTEXT_32K),
        "--max-concurrent-requests",
        "2",
        "--max-body-bytes",
        str(MAX_BODY),
    ),
    shared=True,
)

# An API key and a short stall timeout, on the `long_token_dir` model (16 KB of text per
# token): it fills socket buffers fast, so a client that reads nothing stalls within a
# second (the auth, request id and metrics tests).
API_KEY = "test-key-0123456789"
AUTH = {"authorization": f"Bearer {API_KEY}"}
STALL_S = 1.0
KEY_SERVER = ServerSpec(
    "long_token_dir",
    (
        "--max-seq-len",
        "4096",
        "--api-key",
        API_KEY,
        "--client-stall-timeout",
        str(STALL_S),
        "--max-pending-bytes",
        str(256 << 20),  # only the stall timeout ends a stalled stream here
    ),
    shared=True,
)

# what the server puts in X-Request-Id when the client sent none (or an unusable one)
GENERATED_ID = re.compile(r"^[A-Za-z0-9._:\-]{8,128}$")


def chat_url(server: RunningServer) -> str:
    return server.base_url + CHAT_PATH


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


# ---------------------------------------------------------------- requests
def chat_body(model: str, content: str = "hi", **params: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **params}


def tokens_body(server: RunningServer, n: int, **params: Any) -> dict[str, Any]:
    """A chat request to `server` for exactly `n` tokens (`ignore_eos`: it never ends
    early); `params` may set the `content` and other fields."""
    return chat_body(server.model_name, max_tokens=n, ignore_eos=True, **params)


def prompt_len(model_dir: Path | str, messages: list[dict[str, str]]) -> int:
    """Token count of `messages` rendered by the model's chat template, as a client would
    count it with the Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- answers
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


def chunk_text(chunks: list[dict]) -> str:
    """The text of choice 0 of streamed chat chunks."""
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)


def assert_completed_stream(raw: bytes) -> list[dict]:
    """A stream that ended normally: chunks, one finish_reason chunk, one [DONE]."""
    assert raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1, raw[-300:]
    chunks = sse_chunks(raw)
    assert all(c.get("object") == "chat.completion.chunk" for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    return chunks


def assert_error_event_then_done(raw: bytes, code: str) -> None:
    """A stream that began and then ended with `data: {"error": ...}` and `data: [DONE]`."""
    assert raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1, raw[-300:]
    payloads = sse_payloads(raw)
    assert_error_body(json.loads(payloads[-2]), code)
    assert b'"finish_reason":"length"' not in raw


# ---------------------------------------------------------------- the server's state
def wait_state(server: RunningServer, check: Callable[[dict], bool], timeout: float = 30.0):
    """Poll /debug/lifecycle until `check(state)` holds; return that state."""
    deadline = time.monotonic() + timeout
    while not check(state := server.lifecycle()):
        assert time.monotonic() < deadline, f"state never reached: {state}"
        time.sleep(0.02)
    return state


def n_running(n: int) -> Callable[[dict], bool]:
    """For `wait_state`: the scheduler runs exactly `n` requests."""
    return lambda state: state["scheduler"]["running"] == n


def ipc_dirs() -> set[Path]:
    """The IPC directories of every server on the machine (not the test logs)."""
    tmp = Path(tempfile.gettempdir())
    return set(tmp.glob("minisgl-*")) - set(tmp.glob("minisgl-test-*"))


def _in_use(d: Path) -> bool:
    """Whether a live process still holds a unix socket inside `d` (another server's)."""
    return f" {d}/" in Path("/proc/net/unix").read_text()


def assert_no_new_ipc_dirs(before: set[Path], grace: float = 30.0) -> None:
    """No IPC directory has appeared since `before` that no live process uses. Another
    server starting on the machine meanwhile owns a directory before it binds a socket in
    it; such a directory comes into use (or goes) within its start-up, a leaked one never
    does, so the check is repeated for up to `grace` seconds."""
    deadline = time.monotonic() + grace
    while leftover := {d for d in ipc_dirs() - before if not _in_use(d)}:
        if time.monotonic() > deadline:
            raise AssertionError(f"new IPC directories left behind: {leftover}")
        time.sleep(0.2)


# ---------------------------------------------------------------- streams and raw sockets
class HeldStream:
    """A streaming request held open: headers in, the body read on demand."""

    def __init__(self, http: httpx.AsyncClient, url: str, body: dict, **kw) -> None:
        self._cm = http.stream("POST", url, json=body, **kw)
        self.raw = b""
        self.ended_at: float | None = None

    async def __aenter__(self) -> HeldStream:
        self.response = await self._cm.__aenter__()
        self._parts = self.response.aiter_raw()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._cm.__aexit__(*exc)

    async def first(self) -> bytes:
        part = await anext(self._parts)
        self.raw += part
        return part

    async def rest(self) -> bytes:
        try:
            async for part in self._parts:
                self.raw += part
        except httpx.RemoteProtocolError:  # cut mid-stream: also an end
            pass
        self.ended_at = time.monotonic()
        return self.raw


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


def read_until_closed(
    sock: socket.socket,
    into: bytearray,
    timeout: float = 10.0,
    ends: tuple[type[OSError], ...] = (ConnectionResetError,),
) -> bytes:
    """Read into `into` until the server closes the connection, or one of `ends` (a reset;
    other errors, a timeout included, are raised unless listed); return all read."""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(1 << 16):
            into += chunk
    except ends:
        pass
    return bytes(into)


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


# ---------------------------------------------------------------- metrics
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_metrics(server) -> Samples:
    """The server's GET /metrics (with the operator's key where keys are set), parsed:
    {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    key = server.operator_key
    headers = {"authorization": f"Bearer {key}"} if key else None
    r = httpx.get(f"{server.base_url}/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when it is not there yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def request_counts(samples: Samples) -> dict[tuple[str, str], float]:
    """minisgl_requests_total as {(outcome, code): count}."""
    out = {}
    for (name, labels), value in samples.items():
        if name == "minisgl_requests_total":
            d = dict(labels)
            out[(d["outcome"], d["code"])] = value
    return out


def changed(after: dict, before: dict) -> dict:
    """The keys whose value changed, with by how much."""
    keys = set(after) | set(before)
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys if after.get(k) != before.get(k)
    }
