"""The live page (GET /debug) in headless Chromium against the real server with an API key:
the browser signs in with HTTP Basic auth (the key as password), the page shows the
requests of a load while they run, with their phases drawn, then their ends, a client
disconnect as an abort where it happened, the three processes' counts and the KV pages;
no script error; and once the page is closed the server holds nothing for it.

Skipped with its reason where /usr/bin/chromium or the playwright package is missing
(`make test` installs chromium where it runs as root)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from e2e_helpers import API_KEY, AUTH, ServerSpec, chat_url, tokens_body

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = pytest.mark.server(
    ServerSpec("long_context_dir", ("--max-seq-len", "2048", "--api-key", API_KEY))
)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} not installed (make test installs chromium as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[dev]')")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


def _stream(server, request_id: str, tokens: int, leave_after: int | None = None) -> None:
    headers = {**AUTH, "X-Request-Id": request_id}
    body = tokens_body(server, tokens, stream=True)
    with httpx.stream("POST", chat_url(server), json=body, headers=headers, timeout=120) as r:
        for i, _ in enumerate(r.iter_raw()):
            if leave_after is not None and i >= leave_after:
                return  # the client goes away mid-stream


def test_the_live_page_shows_requests_running_then_ended(server, browser):
    context = browser.new_context(http_credentials={"username": "me", "password": API_KEY})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base_url + "/debug")
    page.wait_for_selector("#status:has-text('updated')", timeout=10_000)

    load = [
        threading.Thread(target=_stream, args=(server, f"page-{i}", 1500)) for i in range(3)
    ] + [threading.Thread(target=_stream, args=(server, "page-gone", 1500, 20))]
    for t in load:
        t.start()
    try:
        page.wait_for_selector(".row[data-state='running']", timeout=20_000)
        # phases drawn: at least queued/prefill and decode. The first poll that shows a
        # request running can come before its decode phase has begun (a loaded machine):
        # the next polls must draw it while the load still runs
        page.wait_for_function(
            "document.querySelectorAll(\".row[data-state='running'] .seg\").length >= 2",
            timeout=20_000,
        )
        scheduler = page.locator("#p-scheduler").inner_text()
        assert "running" in scheduler and "kv_pages_used" in scheduler
    finally:
        for t in load:
            t.join(120)
    page.wait_for_function(
        "document.querySelectorAll(\".row[data-state='finished']\").length >= 3", timeout=15_000
    )
    aborted = page.locator(".row[data-state='aborted']")
    aborted.first.wait_for(timeout=15_000)
    assert "by client_disconnect" in aborted.first.inner_text()
    assert aborted.first.locator(".mark.bad").count() >= 1  # where it happened
    assert page.locator("#kv polyline").count() == 2
    assert errors == []

    page.close()
    context.close()
    time.sleep(2.5)  # more than two polling periods
    # the page kept nothing alive on the server: no request, no timeline in flight
    state = httpx.get(server.base_url + "/debug/requests", headers=AUTH, timeout=10).json()
    assert state["in_flight"] == [] and state["late_events"] == 0
    assert server.lifecycle()["frontend"]["requests"] == 0
