"""What a learner sees from `pytest tests/quiz --learner` with the exercises untouched: no
tracebacks, one short message per question (in Chinese, as the chapter) naming the file to
edit, what was observed, a hint and the command to check again; the whole output fits a
screen. `--tb=short` brings the tracebacks back for a learner who wants them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _learner_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/quiz", "--learner", "-q", "-p", "no:cacheprovider",
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_an_untouched_learner_run_says_one_short_thing_per_question():
    run = _learner_run()
    out = run.stdout
    assert run.returncode == 1, out[-2000:]
    for q in range(1, 8):
        (line,) = [line for line in out.splitlines() if line.startswith(f"第 {q} 题：")]
        assert f"tests/quiz/exercises/q{q}_" in line, line
        assert f"pytest tests/quiz --learner -m q{q}" in out
    assert out.count("  看到的：") == 7 and out.count("  提示：") == 7
    assert "Traceback" not in out and "raise NotImplementedError" not in out
    assert len(out.splitlines()) < 50, out


def test_tracebacks_come_back_when_asked_for():
    run = _learner_run("-m", "q3", "--tb=short")
    assert "raise NotImplementedError" in run.stdout
    assert "第 3 题：" in run.stdout
