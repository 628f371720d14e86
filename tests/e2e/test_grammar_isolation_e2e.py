"""Hostile constraints over the real server: grammar compilation runs in compile processes
of its own, so a JSON schema that crashes the grammar library (a segfault in its native
code) is one 400 naming `response_format` (or `tools`) and the server serves on; a schema
whose compile outruns --grammar-compile-timeout is a 400 saying so; one larger than
--grammar-max-bytes is refused uncompiled; and while a heavy schema compiles, another
client's request gets its first token as fast as ever. /debug/lifecycle is back at zero
after each test (the fixture checks)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from common import cpu_seconds
from e2e_helpers import ServerSpec, assert_error_body, chat_body, chat_url, wait_state

from minisgl.testing.server import inbox_owner
from minisgl.testing.sse import iter_payloads

COMPILE_TIMEOUT = 3.0
pytestmark = pytest.mark.server(
    ServerSpec(
        "llama",
        (
            "--grammar-compile-timeout",
            str(COMPILE_TIMEOUT),
            "--grammar-max-bytes",
            "3000000",
            "--chat-template",  # a template that shows tools
            "smollm2-tools",
        ),
    )
)

# llguidance 1.x segfaults inside validate_grammar on this one (neighbouring bounds are a
# clean error)
CRASHING = {
    "type": "integer",
    "minimum": -9223372036854775807,
    "maximum": -9223372036854775807,
    "x-guidance": {"whitespace_flexible": False},
}


def _bomb(n: int) -> dict:
    """An enum of n distinct objects: llguidance compiles it in time roughly linear in n
    (seconds for 20,000 on a laptop core)."""
    return {"enum": [{"k": f"v{i:06d}", "n": i} for i in range(n)]}


# about 1.3 MB of schema, well past the time limit; each test its own (a verdict is cached)
BOMB_SIZE = 40_000


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _post(server, stream: bool = False, **params) -> httpx.Response:
    body = chat_body(server.model_name, max_tokens=4, stream=stream, **params)
    return httpx.post(chat_url(server), json=body, timeout=60)


def _assert_still_serves(server) -> None:
    ok = _post(server, response_format=_format({"type": "boolean"}))
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] in ("true", "false")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_a_schema_that_crashes_the_grammar_library_is_a_400_and_the_server_serves_on(
    server, stream
):
    for _ in range(2):  # the second is answered from the compile cache: no second crash
        resp = _post(server, stream=stream, response_format=_format(CRASHING))
        assert resp.status_code == 400, resp.text
        error = assert_error_body(resp.json())
        assert error["param"] == "response_format"
        assert "crashed" in error["message"] and "SIGSEGV" in error["message"], error
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    _assert_still_serves(server)
    # the replaced compile process said it was ready: heard, not left to wake the loop
    tokenizer = inbox_owner(server, "tokenizer")
    before = cpu_seconds(tokenizer)
    time.sleep(2.0)
    assert cpu_seconds(tokenizer) - before < 0.5, "the idle tokenizer worker spins"


def test_a_tool_whose_parameters_crash_the_grammar_library_is_a_400_naming_it(server):
    tools = [
        {"type": "function", "function": {"name": "fine", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "bad", "parameters": CRASHING}},
    ]
    resp = _post(server, tools=tools)
    assert resp.status_code == 400, resp.text
    error = assert_error_body(resp.json())
    assert error["param"] == "tools" and "tools[1] (bad)" in error["message"], error
    assert "crashed" in error["message"], error
    _assert_still_serves(server)


def test_a_schema_that_compiles_past_the_time_limit_is_a_400_saying_so(server):
    start = time.monotonic()
    resp = _post(server, response_format=_format(_bomb(BOMB_SIZE)))
    took = time.monotonic() - start
    assert resp.status_code == 400, resp.text
    error = assert_error_body(resp.json())
    assert error["param"] == "response_format", error
    assert f"longer than {COMPILE_TIMEOUT:g} s" in error["message"], error
    assert took < COMPILE_TIMEOUT + 15, took  # killed at the limit, not compiled to the end
    _assert_still_serves(server)


def test_a_schema_larger_than_the_size_limit_is_refused_uncompiled(server):
    huge = _bomb(105_000)  # over 3,000,000 bytes (and under the 4 MiB body limit)
    assert len(json.dumps(huge)) > 3_000_000
    resp = _post(server, response_format=_format(huge))
    assert resp.status_code == 400, resp.text
    error = assert_error_body(resp.json())
    assert error["param"] == "response_format" and "--grammar-max-bytes" in error["message"]


def test_another_client_s_first_token_stays_fast_while_a_heavy_schema_compiles(server):
    def ttft() -> float:
        body = chat_body(server.model_name, max_tokens=2, stream=True, ignore_eos=True)
        start = time.monotonic()
        with httpx.stream("POST", chat_url(server), json=body, timeout=60) as r:
            for payload in iter_payloads(r.iter_lines()):  # the first chunk with output
                if '"content"' in payload or '"finish_reason":"' in payload:
                    return time.monotonic() - start
        raise AssertionError("the stream ended without output")

    ttft()  # warm
    heavy: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: heavy.append(_post(server, response_format=_format(_bomb(BOMB_SIZE + 1))))
    )
    thread.start()
    # parsed and tokenized (a 1.3 MB body takes a while on a busy machine): compiling now
    wait_state(server, lambda state: state["tokenizer"]["grammar_compiles"] == 1)
    during = []  # first-token latencies measured while it compiled
    while thread.is_alive():
        took = ttft()
        if thread.is_alive():
            during.append(took)
    thread.join()
    assert heavy[0].status_code == 400, heavy[0].text  # it ran into its time limit
    assert during, "the heavy schema ended before another request did: no contest"
    # on the tokenizer worker's loop, the heavy compile would hold every other request back
    # until it ended (its whole time limit); beside it, the others are not held at all
    assert max(during) < COMPILE_TIMEOUT / 3, during
