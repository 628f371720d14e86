"""Tenants sharing one server (tiny Llama): with two API keys and --cache-salt-per-key,
one tenant's prompt prefix is never served from the cache to the other (the prefix cache's
hit counter in /debug/lifecycle shows it), a request's own `cache_salt` separates it further,
and with --hide-cached-tokens no answer tells `cached_tokens`; both keys are accepted, any
other refused; lifecycle back at zero after each test (the fixture)."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import ServerSpec, chat_url

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
pytestmark = pytest.mark.server(
    ServerSpec(
        "long_context_dir",
        (
            "--max-seq-len", "2048", "--page-size", "4", "--api-key", f"{ALICE},{BOB}",
            "--cache-salt-per-key", "--hide-cached-tokens",
        ),
    )
)  # fmt: skip
SYSTEM = "You are a terse assistant for the ACME company. " * 8  # many shared pages


def _hits(server) -> int:
    return server.lifecycle()["scheduler"]["prefix_cache_hit_tokens"]


def _ask(server, key: str, question: str, **extra) -> dict:
    body = {
        "model": server.model_name,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        **extra,
    }
    r = httpx.post(
        chat_url(server), json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_tenants_never_share_cached_prefixes_and_usage_tells_nothing(server):
    start = _hits(server)
    first = _ask(server, ALICE, "What is 1 + 1?")
    assert "prompt_tokens_details" not in first["usage"]
    assert _hits(server) == start  # nothing cached yet
    _ask(server, ALICE, "What is 2 + 2?")
    alice_hit = _hits(server) - start
    assert alice_hit > 40  # the shared system prompt, from Alice's own first request
    _ask(server, BOB, "What is 1 + 1?")  # the very prompt Alice sent first
    assert _hits(server) - start == alice_hit  # Bob learns nothing of it
    _ask(server, BOB, "What is 3 + 3?")
    assert _hits(server) - start > alice_hit  # Bob's own pages serve Bob


def test_a_request_s_own_cache_salt_separates_it_further(server):
    start = _hits(server)
    _ask(server, ALICE, "Salted question?", cache_salt="session-1")
    _ask(server, ALICE, "Another?", cache_salt="session-2")
    assert _hits(server) == start
    _ask(server, ALICE, "Third?", cache_salt="session-1")
    assert _hits(server) > start


def test_both_keys_open_the_api_and_no_other_does(server):
    for key, status in ((ALICE, 200), (BOB, 200), ("carol", 401), (f"{ALICE},{BOB}", 401)):
        r = httpx.get(f"{server.base_url}/v1/models", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == status, (key, r.text)
    r = httpx.post(chat_url(server), json={"messages": [], "cache_salt": ""}, headers={
        "authorization": f"Bearer {ALICE}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
