"""The SSE bytes on the wire (tiny Qwen3): `data: <json>\\n\\n` events, one chat id, and
exactly one `data: [DONE]\\n\\n` at the very end."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_helpers import SSE_DONE, ServerSpec, chat_body, chat_url
from openai.types.chat import ChatCompletionChunk

from minisgl.testing.sse import DONE, sse_chunks, sse_payloads

pytestmark = pytest.mark.server(ServerSpec("qwen3"))


def _stream_raw(server, **params) -> tuple[httpx.Response, bytes]:
    body = chat_body(server.model_name, "Streaming responses send tokens", stream=True, **params)
    with httpx.stream("POST", chat_url(server), json=body, timeout=30) as r:
        raw = b"".join(r.iter_raw())
    return r, raw


@pytest.mark.parametrize("max_tokens", [1, 16])
def test_every_event_is_a_data_line_and_done_comes_once_at_the_end(server, max_tokens):
    r, raw = _stream_raw(server, max_tokens=max_tokens, ignore_eos=True)
    assert r.status_code == 200
    assert r.headers["content-type"].split(";")[0].strip() == "text/event-stream"
    assert raw.endswith(SSE_DONE) and raw.count(SSE_DONE) == 1
    payloads = sse_payloads(raw)
    assert payloads[-1] == DONE and DONE not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk, strict=True)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chunk_ids_are_one_chatcmpl_id(server):
    _, raw = _stream_raw(server, max_tokens=10, ignore_eos=True)
    chunks = sse_chunks(raw)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {server.model_name}
    assert len({c["created"] for c in chunks}) == 1


def test_two_streams_have_different_ids(server):
    ids = []
    for _ in range(2):
        _, raw = _stream_raw(server, max_tokens=2)
        ids.append(json.loads(sse_payloads(raw)[0])["id"])
    assert ids[0] != ids[1]
