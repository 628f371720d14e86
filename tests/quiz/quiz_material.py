"""Where the quiz's exercises and solutions are, and how a test gets one of them.

Contract: `QUESTIONS` maps each question's marker (q1..q7) to its exercise file name and
the question in a line; the learner edits `EXERCISES / name`, the reference solution is
`SOLUTIONS / name`, both with the same interface. `FAULTY` names the designs the chapter
warns about (`FAULTY_DIR / file`, with the interface of their question's exercise), each
with its question and the words its failure must say. `load(path)` imports such a file
by its path (once per session), under a name that tells the folders apart.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

QUIZ = Path(__file__).resolve().parent
ROOT = QUIZ.parents[1]
EXERCISES = QUIZ / "exercises"
SOLUTIONS = QUIZ / "solutions"
FAULTY_DIR = QUIZ / "faulty"

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

# faulty design: (its question, what a failure of that question's tests must say)
FAULTY = {
    "q1_calls_generate_on_the_loop.py": ("q1", "事件循环一圈也没转"),
    "q3_event_only.py": ("q3", "事件只是一个标志，不携带数据"),
    "q3_list_only.py": ("q3", "永远醒不过来"),
    "q4_take_await_clear.py": ("q4", "一次唤醒丢了"),
    "q4_spins.py": ("q4", "轮询或空转"),
    "q4_polls.py": ("q4", "轮询或空转"),
    "q5_creates_state.py": ("q5", "创建了状态"),
    "q6_headers_first.py": ("q6", "在第一个输出之前就发了"),
    "q7_cleanup_after_the_yield.py": ("q7", "它的请求状态却还在"),
    "q7_awaits_on_the_way_out.py": ("q7", "在退出途中又被取消了一次"),
    "q7_aborts_always.py": ("q7", "终止回复已经到了，却还是发了 AbortMsg"),
    "q7_cleans_up_later.py": ("q7", "却还在 `states` 里"),
}

_loaded: dict[Path, ModuleType] = {}


def load(path: Path) -> ModuleType:
    """Import one exercise or solution file by its path."""
    path = path.resolve()
    if path not in _loaded:
        if not path.is_file():
            raise FileNotFoundError(f"找不到练习文件 {path}")
        spec = importlib.util.spec_from_file_location(f"quiz_{path.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[path] = module
    return _loaded[path]
