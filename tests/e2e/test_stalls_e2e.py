"""No single request freezes the other clients' streams (the embedded model on the CPU,
where a step is slow enough to tell): while a long prompt prefills (paced into chunks of
about --prefill-step-seconds while others decode) or a huge prompt is refused (its text
cannot fit the context: refused before it is tokenized), a stream that was already running
never waits much longer than a step for its next token. The bound is generous for a busy
CI machine; the figures themselves are benchmarks/isolation.py's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from e2e_helpers import DEFAULT_MODEL_SERVER, chat_body, chat_url

pytestmark = [pytest.mark.server(DEFAULT_MODEL_SERVER), pytest.mark.slow]

WORST_GAP_S = 4.0  # unpaced, a 3000-token prompt holds every stream for far longer


def _gaps_while(server, heavy_body: dict) -> tuple[list[float], httpx.Response]:
    """Stream one answer; meanwhile send `heavy_body`. The stream's gaps between chunks
    while the heavy request was in flight, and the heavy request's answer."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        body = chat_body(server.model_name, "Tell me a story.", max_tokens=400, stream=True)
        body["ignore_eos"] = True
        with httpx.stream("POST", chat_url(server), json=body, timeout=300) as r:
            for _ in r.iter_lines():
                arrivals.append(time.monotonic())
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    started.wait(60)
    time.sleep(0.5)
    begin = time.monotonic()
    answer = httpx.post(chat_url(server), json=heavy_body, timeout=300)
    end = time.monotonic()
    reader.join()
    assert arrivals[-1] > end, "the stream ended before the heavy request did: no contest"
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= begin and a <= end]
    return during, answer


def test_a_long_prompt_does_not_freeze_the_other_streams(server):
    words = " ".join(f"word{i % 97}" for i in range(1500))  # about 3000 tokens
    heavy = chat_body(server.model_name, words, max_tokens=1)
    during, answer = _gaps_while(server, heavy)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 2500
    assert during and max(during) < WORST_GAP_S, max(during)


def test_a_huge_prompt_is_refused_without_freezing_the_other_streams(server):
    huge = chat_body(server.model_name, "x" * 3_900_000, max_tokens=1)
    during, answer = _gaps_while(server, huge)
    assert answer.status_code == 400, answer.text[:300]
    assert "context" in answer.json()["error"]["message"]
    assert max(during, default=0.0) < WORST_GAP_S, max(during)
