"""Admission control on the real server (tiny Llama, 32k context, at most two requests at
once): a request past --max-concurrent-requests gets 503 with Retry-After at once instead
of waiting in a queue, for streams and non-streams alike; the server stays healthy, a
freed slot is served again, and /debug/lifecycle ends at zero. A request whose prompts x n
reach the limit would take every slot (or could never be admitted): it is a 400 naming
`prompt`, not a 503 to retry."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2e_helpers import (
    ENDLESS,
    GENERATED_ID,
    LIMITS_SERVER,
    HeldStream,
    assert_completed_stream,
    assert_error_body,
    chat_url,
    tokens_body,
)

pytestmark = pytest.mark.server(LIMITS_SERVER)


async def test_requests_past_the_concurrency_limit_get_503_with_retry_after_at_once(server):
    url = chat_url(server)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as http:
        # one stream that will finish on its own, one that only the client ends
        finishing = HeldStream(http, url, tokens_body(server, 3000, stream=True))
        held = HeldStream(http, url, tokens_body(server, ENDLESS, stream=True))
        async with finishing, held:
            assert finishing.response.status_code == held.response.status_code == 200
            await finishing.first()
            await held.first()
            assert server.lifecycle()["frontend"]["requests"] == 2

            async def refused(stream: bool) -> tuple[httpx.Response, float]:
                start = time.monotonic()
                r = await http.post(url, json=tokens_body(server, 4, stream=stream))
                return r, time.monotonic() - start

            burst = await asyncio.gather(*(refused(i % 2 == 1) for i in range(8)))
            for r, took in burst:
                assert r.status_code == 503, r.text
                assert_error_body(r.json(), "overloaded")
                assert r.json()["error"]["type"] == "server_error"
                assert int(r.headers["retry-after"]) >= 1
                assert GENERATED_ID.match(r.headers["x-request-id"])
                # a queued request would wait minutes for the held stream
                assert took < 5.0
            # nothing queued behind the two, and a busy server is still healthy
            assert server.lifecycle()["frontend"]["requests"] == 2
            assert (await http.get(server.base_url + "/health")).status_code == 200

            assert_completed_stream(await finishing.rest())
            # one slot free again: a request is served while the held stream runs on
            r = await http.post(url, json=tokens_body(server, 4))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        # leaving the block closed the held stream: both slots free
        server.wait_zero(2.0)
        again = await asyncio.gather(
            *(http.post(url, json=tokens_body(server, 4)) for _ in range(2))
        )
        assert [r.status_code for r in again] == [200, 200]
    server.wait_zero(1.0)


def test_a_request_that_could_never_fit_is_a_400_not_a_retry(server):
    """Where two requests run at once: three prompts could never be admitted, two would
    take every slot."""
    url = server.base_url + "/v1/completions"
    body = {"model": server.model_name, "prompt": ["a", "b", "c"], "max_tokens": 2}
    for stream in (False, True):
        r = httpx.post(url, json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        assert "retry-after" not in r.headers
        err = assert_error_body(r.json(), "too_many_prompts")
        assert err["param"] == "prompt" and "--max-concurrent-requests" in err["message"]
    # prompts x n past the cap on one request's sequences
    r = httpx.post(url, json={**body, "prompt": ["a"] * 65, "n": 16}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # as many sequences as the limit would take every slot from every other client:
    # two prompts, or one prompt with n=2
    for extra in ({"prompt": ["a", "b"]}, {"prompt": ["a"], "n": 2}):
        r = httpx.post(url, json={**body, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        assert assert_error_body(r.json(), "too_many_prompts")["param"] == "prompt"
    # one sequence fewer than the limit: served
    r = httpx.post(url, json={**body, "prompt": ["a"]}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    server.wait_zero(2.0)
