"""The API key on the real server (tiny Llama with --api-key): every /v1 route answers 401
invalid_api_key to a request without exactly `Authorization: Bearer <key>`, before its body
is even parsed, keeping the client's X-Request-Id and never echoing the key; the right key
is served, /health and /debug/lifecycle stay open (the latter telling sizes only to the
key), POST /debug/flush_cache and /metrics are the key's (one key: its holder is the
operator), each 401 is counted in /metrics as an error, and the key may come from
MINISGL_API_KEY instead of the flag."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import (
    API_KEY,
    AUTH,
    CHAT_PATH,
    KEY_SERVER,
    assert_completed_stream,
    assert_error_body,
    changed,
    chat_body,
    chat_url,
    request_counts,
    scrape_metrics,
)

pytestmark = pytest.mark.server(KEY_SERVER)


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer wrong-key", f"Bearer {API_KEY}x", API_KEY, f"Basic {API_KEY}", "Bearer"],
    ids=["missing", "wrong", "longer", "no_scheme", "basic", "empty"],
)
def test_v1_routes_without_the_right_bearer_key_get_401(server, auth):
    headers = {"x-request-id": "auth-probe"}
    if auth is not None:
        headers["authorization"] = auth
    body = chat_body(server.model_name, max_tokens=1)
    requests = [
        ("GET", "/v1/models", None),
        ("POST", CHAT_PATH, body),
        ("POST", CHAT_PATH, {**body, "stream": True}),
        ("POST", CHAT_PATH, b"not json at all"),  # refused before it is parsed
        ("GET", "/v1/no-such-route", None),
    ]
    for method, path, payload in requests:
        kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        r = httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kw)
        assert r.status_code == 401, (path, r.text)
        assert_error_body(r.json(), "invalid_api_key")
        assert r.headers["x-request-id"] == "auth-probe"
        assert "invalid_api_key" in r.text and API_KEY not in r.text
    server.wait_zero(1.0)


def test_the_right_bearer_key_is_served_and_other_routes_stay_open(server):
    base = server.base_url
    body = chat_body(server.model_name, max_tokens=2, ignore_eos=True)
    r = httpx.post(chat_url(server), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    with httpx.stream("POST", chat_url(server), json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        assert_completed_stream(r.read())
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/debug/lifecycle"):
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    server.wait_zero(1.0)


def test_metrics_are_the_key_s_and_lifecycle_tells_sizes_only_to_it(server):
    """/metrics counts each request's prompt tokens looked up in and found in the prefix
    cache: with a key set, only its holder reads them; /debug/lifecycle stays open for
    the zero check, without the cache's totals and with sizes rounded up to powers of two."""
    base = server.base_url
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert_error_body(r.json(), "invalid_api_key")
    assert "prefix_cache" in httpx.get(base + "/metrics", headers=AUTH, timeout=10).text
    body = chat_body(server.model_name, max_tokens=2, ignore_eos=True)
    assert httpx.post(chat_url(server), json=body, headers=AUTH, timeout=30).status_code == 200
    exact = httpx.get(base + "/debug/lifecycle", headers=AUTH, timeout=10).json()
    open_ = httpx.get(base + "/debug/lifecycle", timeout=10).json()
    assert exact["scheduler"]["prefix_cache_query_tokens"] > 0
    assert "prefix_cache_query_tokens" not in open_["scheduler"]
    assert "prefix_cache_hit_tokens" not in open_["scheduler"]
    assert open_["frontend"] == exact["frontend"]  # nothing in flight: zeros, as they are
    assert open_["scheduler"]["kv_pages_total"] == exact["scheduler"]["kv_pages_total"]
    server.wait_zero(1.0)


def test_flush_cache_is_an_admin_route_behind_the_key(server):
    url = server.base_url + "/debug/flush_cache"
    for path in (url, url + "/", url + "?x=1"):
        r = httpx.post(path, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert_error_body(r.json(), "invalid_api_key")
    r = httpx.post(url, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["flushed_pages"] >= 0, r.text


def test_401_answers_are_counted_as_errors(server):
    before = scrape_metrics(server)
    for _ in range(3):
        r = httpx.post(chat_url(server), json=chat_body(server.model_name), timeout=30)
        assert r.status_code == 401
    after = scrape_metrics(server)
    assert changed(request_counts(after), request_counts(before)) == {
        ("error", "invalid_api_key"): 3
    }


def test_api_key_from_the_environment(start_server):
    s = start_server("llama", env={"MINISGL_API_KEY": API_KEY})
    assert httpx.get(s.base_url + "/v1/models", timeout=10).status_code == 401
    r = httpx.get(s.base_url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == s.model_name
    assert httpx.get(s.base_url + "/health", timeout=10).status_code == 200
    assert s.stop() == 0
