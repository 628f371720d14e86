"""Test doubles and harnesses shared by the tests, the notebooks, the quiz and the benchmarks.

- `fakes`: `FakeBackend`, the far side of a FrontendManager's two channels (a stand-in for
  the tokenizer worker), and small asyncio helpers for driving it; `FakeScheduler`, the
  scheduler's per-request state without a model (the quiz's pipeline, the frontend
  benchmark's stand-in scheduler process); `scheduler_state`, a scheduler's answer to a
  state query with the counts a test gives.
- `server`: `RunningServer`, the real three-process server (`python -m minisgl`) on a free
  port, with /debug/lifecycle at hand.
- `sse`: the one reader of server-sent events (`sse_payloads`, `sse_chunks`,
  `iter_payloads`, ...), strict about the framing minisgl sends.

They live in the package, not beside the tests, so that every reader imports them the same
way (`from minisgl.testing import FakeBackend`) without editing `sys.path`. Importing this
package imports neither torch nor an HTTP client; the submodules import what they use.
"""

from __future__ import annotations

from .fakes import (
    FakeBackend,
    FakeScheduler,
    listening,
    make_frontend,
    scheduler_state,
    settle,
    wait_until,
)

__all__ = [
    "FakeBackend",
    "FakeScheduler",
    "listening",
    "make_frontend",
    "scheduler_state",
    "settle",
    "wait_until",
]
