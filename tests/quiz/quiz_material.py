"""Where the quiz's exercises and solutions are, and how a test gets one of them.

Contract: `QUESTIONS` maps each question's marker (q1..q7) to its exercise file name and
the question in a line; the learner edits `EXERCISES / name`, the reference solution is
`SOLUTIONS / name`, both with the same interface. `load(path)` imports such a file by its
path (once per session), under a name that tells the two folders apart.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

QUIZ = Path(__file__).resolve().parent
ROOT = QUIZ.parents[1]
EXERCISES = QUIZ / "exercises"
SOLUTIONS = QUIZ / "solutions"

# marker: (exercise file, the question)
QUESTIONS = {
    "q1": ("q1_off_the_loop.py", "a blocking call inside `async def` stalls every connection"),
    "q2": ("q2_request_fields.py", "where messages, max_tokens and stream go"),
    "q3": ("q3_buffer_and_event.py", "why both a reply buffer and a wake-up event"),
    "q4": ("q4_consumer_loop.py", "several set() merged into one wake-up lose no reply"),
    "q5": ("q5_route_by_uid.py", "interleaved A/B replies reach only their own request"),
    "q6": ("q6_sse_stream.py", "the anatomy of the SSE stream, errors before and after it"),
    "q7": ("q7_request_scope.py", "early exit, cancellation and errors: what cleans up"),
}

_loaded: dict[Path, ModuleType] = {}


def load(path: Path) -> ModuleType:
    """Import one exercise or solution file by its path."""
    path = path.resolve()
    if path not in _loaded:
        if not path.is_file():
            raise FileNotFoundError(f"no exercise file {path}")
        spec = importlib.util.spec_from_file_location(f"quiz_{path.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[path] = module
    return _loaded[path]
