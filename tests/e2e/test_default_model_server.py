"""The embedded default model (SmolLM2-135M-Instruct, real weights) behind the real server:
the chapter's request works streamed and not, and greedy answers make sense."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import SSE_DONE, ServerSpec, chat_body, chat_url, chunk_text, sse_chunks

CHAPTER_PROMPT = "什么是 KV Cache？"

pytestmark = pytest.mark.server(ServerSpec(None))


def test_chapter_request_non_streaming(server):
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32)
    r = httpx.post(chat_url(server), json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "SmolLM2-135M-Instruct"
    assert out["choices"][0]["message"]["content"].strip()
    assert out["choices"][0]["finish_reason"] in {"stop", "length"}
    assert 1 <= out["usage"]["completion_tokens"] <= 32


def test_chapter_request_streaming(server):
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32, stream=True)
    with httpx.stream("POST", chat_url(server), json=body, timeout=120) as r:
        raw = r.read()
    assert r.status_code == 200 and raw.endswith(SSE_DONE)
    chunks = sse_chunks(raw)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    assert chunk_text(chunks).strip()


def test_chapter_request_greedy_text_is_whole_characters(server):
    """Greedy output, streamed or not, is the same text with no U+FFFD in it: multi-byte
    characters split across tokens are held back until complete."""
    body = chat_body(server.model_name, CHAPTER_PROMPT, max_tokens=32, temperature=0)
    full = httpx.post(chat_url(server), json=body, timeout=120).json()
    text = full["choices"][0]["message"]["content"]
    with httpx.stream("POST", chat_url(server), json={**body, "stream": True}, timeout=120) as r:
        raw = r.read()
    streamed = chunk_text(sse_chunks(raw))
    assert text.strip() and "\ufffd" not in text
    assert streamed == text


def test_capital_of_france_is_paris_via_the_openai_client(server, client):
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content
