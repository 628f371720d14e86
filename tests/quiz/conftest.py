"""Quiz markers: one per question of the chapter's quiz, so `pytest -m q3` runs one answer."""

from __future__ import annotations

import sys
from pathlib import Path

# the deliberately broken, reference-style managers used for contrast live beside the
# notebooks (notebooks/naive.py), which use them too; never in the minisgl package
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "notebooks"))

QUESTIONS = {
    "q1": "a blocking call inside `async def` stalls every other connection",
    "q2": "where messages, max_tokens and stream go",
    "q3": "why both a reply list and a wake-up event",
    "q4": "several set() merged into one wake-up lose no reply",
    "q5": "interleaved A/B replies reach only their own consumer; state is cleaned up",
    "q6": "the anatomy of the SSE stream",
    "q7": "early exit after `finished`, cancellation and errors: what cleans up",
}


def pytest_configure(config):
    for name, question in QUESTIONS.items():
        config.addinivalue_line("markers", f"{name}: quiz question {name[1:]}: {question}")
