"""The chapter's quiz as exercises: one marker and one exercise file per question.

Contract:
- `pytest tests/quiz` runs every quiz test against the reference solutions
  (tests/quiz/solutions/), and checks the exercise material itself (test_exercises_work.py).
- `pytest tests/quiz --learner` runs the same tests against the learner's files
  (tests/quiz/exercises/); `--learner-dir PATH` (not listed in --help) points at another
  folder with the same file names, which the material's self-test uses. A learner's run
  skips the self-test: it is about the material, not about the learner's answers.
- `-m q3` selects one question: every quiz test carries its question's marker.
- A test gets its question's module from the `exercise` fixture, found by its marker.
  In a learner's run, each failure names the file to edit.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest
from quiz_material import EXERCISES, QUESTIONS, QUIZ, ROOT, SOLUTIONS, load

SELF_TEST = "test_exercises_work.py"
TEST_TIMEOUT = 30  # seconds; a quiz test takes well under one


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("quiz")
    group.addoption(
        "--learner",
        action="store_true",
        help="run the quiz against your own files in tests/quiz/exercises/",
    )
    group.addoption("--learner-dir", type=Path, default=None, help=argparse.SUPPRESS)


def pytest_configure(config: pytest.Config) -> None:
    for name, (_, question) in QUESTIONS.items():
        config.addinivalue_line("markers", f"{name}: quiz question {name[1:]}: {question}")


def learner_dir(config: pytest.Config) -> Path | None:
    """Where the learner's files are, or None when the reference solutions are tested."""
    if config.getoption("learner_dir") is not None:
        return config.getoption("learner_dir").resolve()
    return EXERCISES if config.getoption("learner") else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name == SELF_TEST and learner_dir(config) is not None:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # an answer that loses a wake-up hangs for ever: fail it after a while instead
    for item in items:
        if QUIZ in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


def pytest_report_header(config: pytest.Config) -> str:
    where = learner_dir(config)
    if where is None:
        return f"quiz: the reference solutions in {SOLUTIONS.relative_to(ROOT)}"
    return f"quiz: the learner's files in {where}"


def question_of(item: pytest.Item) -> str | None:
    return next((q for q in QUESTIONS if item.get_closest_marker(q) is not None), None)


@pytest.fixture
def exercise(request: pytest.FixtureRequest) -> ModuleType:
    """This question's module: the learner's file, or the reference solution."""
    question = question_of(request.node)
    assert question is not None, "a test that uses `exercise` needs a q1..q7 marker"
    filename = QUESTIONS[question][0]
    return load((learner_dir(request.config) or SOLUTIONS) / filename)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    where = learner_dir(item.config)
    if report.failed and where is not None and "exercise" in getattr(item, "fixturenames", ()):
        filename = QUESTIONS[question_of(item)][0]
        path = where / filename
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        report.sections.append(("exercise", f"this test checks your file {shown}"))
    return report
