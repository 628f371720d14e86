"""Slots shared between clients on the real server (tiny Llama, 32k context, at most two
requests at once, two API keys: two clients). Client A holds both slots; B is refused with
503 and Retry-After, and so waits; when one of A's streams ends, A's next request is refused
(it holds its share, 1 of 2, while B waits) and B's retry is served. /debug/lifecycle ends
at zero (the fixture)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2e_helpers import ENDLESS, HeldStream, ServerSpec, assert_error_body, chat_url, tokens_body

KEY_A, KEY_B = "key-a-0123456789", "key-b-0123456789"
pytestmark = pytest.mark.server(
    ServerSpec(
        "context_32k_dir",
        (
            "--max-seq-len",
            "32768",
            "--max-concurrent-requests",
            "2",
            "--api-key",
            f"{KEY_A},{KEY_B}",
        ),
    )
)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_freed_slot_goes_to_the_client_that_waited(server):
    url = chat_url(server)
    endless = tokens_body(server, ENDLESS, stream=True)
    async with httpx.AsyncClient(timeout=60) as http:
        first = HeldStream(http, url, endless, headers=_auth(KEY_A))
        second = HeldStream(http, url, endless, headers=_auth(KEY_A))
        async with first:
            async with second:
                await first.first()
                await second.first()
                r = await http.post(url, json=tokens_body(server, 2), headers=_auth(KEY_B))
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                assert_error_body(r.json(), "overloaded")
            deadline = time.monotonic() + 10  # the server notices the closed stream
            while server.lifecycle()["frontend"]["requests"] != 1:
                assert time.monotonic() < deadline, server.lifecycle()
                await asyncio.sleep(0.05)
            # one slot free; A holds its share while B waits
            r = await http.post(url, json=tokens_body(server, 2), headers=_auth(KEY_A))
            assert r.status_code == 503, r.text
            assert "its share" in assert_error_body(r.json(), "overloaded")["message"]
            r = await http.post(url, json=tokens_body(server, 2), headers=_auth(KEY_B))
            assert r.status_code == 200, r.text
    server.wait_zero(2.0)
