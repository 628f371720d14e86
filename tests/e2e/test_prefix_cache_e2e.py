"""The prefix cache over the real server (tiny Llama, 4-token pages) with the official
client: a chat's later turns report the history they reuse as
`usage.prompt_tokens_details.cached_tokens`, streaming or not; /metrics counts lookups and
hits under vLLM's names; POST /debug/flush_cache empties the cache when idle and answers 409
while a request is in flight; /debug/lifecycle tells live pages (back at zero) from cached
ones."""

from __future__ import annotations

import uuid

import httpx
import pytest
from e2e_helpers import PROTOCOL_SERVER, HeldStream, chat_url, metric, scrape_metrics, tokens_body

pytestmark = pytest.mark.server(PROTOCOL_SERVER)


def _system() -> dict[str, str]:
    """A system prompt no other test sends: nothing of it is cached before the test."""
    words = " ".join(uuid.uuid4().hex for _ in range(6))
    return {"role": "system", "content": f"You answer briefly. Session {words}."}


def _ask(client, server, messages: list[dict], stream: bool = False):
    """(answer text, usage) of one chat turn of 6 tokens."""
    params = dict(model=server.model_name, messages=messages, max_tokens=6)
    params["extra_body"] = {"ignore_eos": True}
    if not stream:
        resp = client.chat.completions.create(**params)
        return resp.choices[0].message.content, resp.usage
    chunks = list(
        client.chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def test_later_chat_turns_report_the_history_they_reuse(server, client):
    before = scrape_metrics(server)
    messages = [_system(), {"role": "user", "content": "What is a KV cache?"}]
    answer, first = _ask(client, server, messages)
    assert first.prompt_tokens_details.cached_tokens == 0
    for turn, stream in enumerate([False, True]):
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
        answer, usage = _ask(client, server, messages, stream)
        cached = usage.prompt_tokens_details.cached_tokens
        # the earlier turns' prompt at least, in whole pages of 4; never the last token
        assert first.prompt_tokens // 4 * 4 - 4 <= cached < usage.prompt_tokens
        assert cached % 4 == 0
    server.wait_zero(1.0)
    after = scrape_metrics(server)
    queries = metric(after, "minisgl_prefix_cache_queries_total")
    hits = metric(after, "minisgl_prefix_cache_hits_total")
    assert queries - metric(before, "minisgl_prefix_cache_queries_total") >= 3
    assert hits - metric(before, "minisgl_prefix_cache_hits_total") >= cached > 0
    assert metric(after, "minisgl_kv_pages_cached") > 0
    assert metric(after, "minisgl_kv_cache_usage_perc") == 0.0  # nothing live


async def test_flush_cache_waits_for_idle_then_empties_the_cache(server, client):
    messages = [_system(), {"role": "user", "content": "Name a colour."}]
    _, first = _ask(client, server, messages)
    _, again = _ask(client, server, messages)
    assert again.prompt_tokens_details.cached_tokens > 0
    url = server.base_url + "/debug/flush_cache"
    async with httpx.AsyncClient(timeout=60) as http:
        async with HeldStream(http, chat_url(server), tokens_body(server, 2000, stream=True)) as s:
            await s.first()
            r = await http.post(url)
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "busy"
    server.wait_zero(5.0)
    r = httpx.post(url, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["flushed_pages"] > 0
    scheduler = server.lifecycle()["scheduler"]
    assert scheduler["kv_pages_cached"] == scheduler["prefix_cache_nodes"] == 0
    _, after = _ask(client, server, messages)  # nothing left to reuse
    assert after.prompt_tokens_details.cached_tokens == 0
    server.wait_zero(1.0)
