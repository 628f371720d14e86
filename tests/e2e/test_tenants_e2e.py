"""Tenants sharing one server (tiny Llama): with two API keys and --cache-salt-per-key,
one tenant's prompt prefix is never served from the cache to the other (the prefix cache's
hit counter in /debug/lifecycle shows it), a request's own `cache_salt` separates it further,
and with --hide-cached-tokens no answer tells `cached_tokens`; both keys are accepted, any
other refused. What tenants may see of each other: a tenant's /debug/requests holds only its
own requests (by request id too), flushing the cache and /metrics need the --admin-key, and
/debug/lifecycle tells the cache's totals only to it. Lifecycle back at zero after each test
(the fixture, which reads it with the admin key)."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import ServerSpec, chat_url

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"
ADMIN = "admin-key-0123456789"
pytestmark = pytest.mark.server(
    ServerSpec(
        "long_context_dir",
        (
            "--max-seq-len", "2048", "--page-size", "4", "--api-key", f"{ALICE},{BOB}",
            "--cache-salt-per-key", "--hide-cached-tokens", "--admin-key", ADMIN,
        ),
    )
)  # fmt: skip
SYSTEM = "You are a terse assistant for the ACME company. " * 8  # many shared pages


def _hits(server) -> int:
    return server.lifecycle()["scheduler"]["prefix_cache_hit_tokens"]


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


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


def _timelines(server, key: str, **params) -> dict:
    r = httpx.get(server.base_url + "/debug/requests", params=params, headers=_bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def _ids(snapshot: dict) -> set[str]:
    return {t["request_id"] for t in snapshot["in_flight"] + snapshot["ended"]}


def test_a_tenant_reads_only_its_own_timelines_and_the_admin_all(server):
    """Finding 10 of the round-4 review: Alice read Bob's timeline by its request id."""
    for key, request_id in ((ALICE, "alice-req-1"), (BOB, "bob-req-1")):
        body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}]}
        headers = {**_bearer(key), "x-request-id": request_id}
        r = httpx.post(chat_url(server), json={**body, "max_tokens": 2}, headers=headers)
        assert r.status_code == 200, r.text
    alice = _timelines(server, ALICE)
    assert "alice-req-1" in _ids(alice) and "bob-req-1" not in _ids(alice)
    assert alice["kv_pages"] == []  # the pool's use over time tells others' sizes
    assert _ids(_timelines(server, ALICE, request_id="bob-req-1")) == set()
    assert _ids(_timelines(server, BOB, request_id="bob-req-1")) == {"bob-req-1"}
    everyone = _timelines(server, ADMIN)
    assert {"alice-req-1", "bob-req-1"} <= _ids(everyone) and everyone["kv_pages"]
    r = httpx.get(server.base_url + "/debug/requests")
    assert r.status_code == 401


def test_flushing_the_cache_and_metrics_need_the_admin_key(server):
    """Finding 10: any tenant could flush the others' cached prefixes; /metrics counted each
    request's cache lookups for anyone."""
    for path, method in (("/debug/flush_cache", "POST"), ("/metrics", "GET")):
        url = server.base_url + path
        r = httpx.request(method, url)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for tenant in (ALICE, BOB):
            r = httpx.request(method, url, headers=_bearer(tenant))
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "admin_key_required"
        r = httpx.request(method, url, headers=_bearer(ADMIN), timeout=30)
        assert r.status_code == 200, r.text
    # the admin key is a key of its own on /v1 too
    assert httpx.get(server.base_url + "/v1/models", headers=_bearer(ADMIN)).status_code == 200


def test_lifecycle_tells_the_cache_s_totals_only_to_the_admin(server):
    """Finding 10: with keys set, /debug/lifecycle's prefix cache totals told anyone each
    request's prompt size and cache hit. It stays open for the zero check."""
    _ask(server, ALICE, "What is 5 + 5?")
    url = server.base_url + "/debug/lifecycle"
    for headers in (None, _bearer(ALICE)):
        seen = httpx.get(url, headers=headers).json()
        assert not {"prefix_cache_query_tokens", "prefix_cache_hit_tokens"} & set(seen["scheduler"])
        assert seen["scheduler"]["running"] == 0 and seen["frontend"]["requests"] == 0
    exact = httpx.get(url, headers=_bearer(ADMIN)).json()
    assert exact["scheduler"]["prefix_cache_query_tokens"] > 0
