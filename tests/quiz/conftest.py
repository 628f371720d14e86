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
- A learner's run prints no tracebacks: at its end, one short message per question that
  failed (in Chinese, as the chapter): how many of its tests failed, the file to edit,
  what the first failing test observed, the first hint of the exercise's docstring and the
  command to check again. `--tb=short` (or any --tb) brings the tracebacks back.
- `--capstone` runs the capstone instead (test_capstone.py, and nothing else): the real
  server with q3-q7 of the folder under test in its request path. Its summary has one
  message per failing check: what it observed, the files likely at fault, a hint, and where
  the server's log is. Without `--capstone` that file is not collected; its self-test
  (test_capstone_works.py) runs with the material's, never in a learner's or capstone run.
  `--capstone-model DIR` (not listed in --help) serves that checkpoint instead of building
  the tiny one.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from types import ModuleType

import pytest
import quiz_capstone
from quiz_material import EXERCISES, QUESTIONS, QUIZ, ROOT, SOLUTIONS, load

SELF_TESTS = ("test_exercises_work.py", "test_capstone_works.py")
CAPSTONE = "test_capstone.py"
FAILED = pytest.StashKey[dict]()  # question -> [tests failed, what the first one observed]
# capstone check's nodeid -> (its title, what it observed, the files at fault, the hint)
CHECKS_FAILED = pytest.StashKey[dict]()
START = (
    "服务器启动并接受请求",
    ("q3", "q4", "q5", "q6", "q7"),
    "服务器在回答请求之前就出了错：先让 pytest tests/quiz --learner 全部通过，再看服务器的日志",
)
TEST_TIMEOUT = 30  # seconds; a quiz test takes well under one


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("quiz")
    group.addoption(
        "--learner",
        action="store_true",
        help="run the quiz against your own files in tests/quiz/exercises/",
    )
    group.addoption("--learner-dir", type=Path, default=None, help=argparse.SUPPRESS)
    group.addoption(
        "--capstone",
        action="store_true",
        help="the capstone: the real server answering with q3-q7 (with --learner: yours)",
    )
    group.addoption("--capstone-model", type=Path, default=None, help=argparse.SUPPRESS)


def pytest_configure(config: pytest.Config) -> None:
    for name, (_, question) in QUESTIONS.items():
        config.addinivalue_line("markers", f"{name}: quiz question {name[1:]}: {question}")
    config.addinivalue_line(
        "markers", "capstone(title, files, hint): one check of the capstone (test_capstone.py)"
    )
    config.stash[FAILED] = {}
    config.stash[CHECKS_FAILED] = {}
    if learner_dir(config) is not None and config.getoption("tbstyle") == "auto":
        config.option.tbstyle = "no"  # the summary below says it in a few lines instead
        config.option.reportchars = ""


def learner_dir(config: pytest.Config) -> Path | None:
    """Where the learner's files are, or None when the reference solutions are tested."""
    if config.getoption("learner_dir") is not None:
        return config.getoption("learner_dir").resolve()
    return EXERCISES if config.getoption("learner") else None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.parent != QUIZ or not collection_path.name.startswith("test_"):
        return None
    capstone = config.getoption("capstone")
    if capstone or collection_path.name == CAPSTONE:
        return collection_path.name != CAPSTONE or not capstone
    if collection_path.name in SELF_TESTS and learner_dir(config) is not None:
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


@pytest.fixture(scope="session")
def pieces_dir(request: pytest.FixtureRequest) -> Path:
    """The folder whose q3-q7 the capstone's server runs."""
    return learner_dir(request.config) or SOLUTIONS


@pytest.fixture(scope="session")
def capstone_model(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    given = request.config.getoption("capstone_model")
    return given or quiz_capstone.tiny_model(tmp_path_factory.mktemp("capstone-model"))


@pytest.fixture(scope="module")
def capstone_server(request: pytest.FixtureRequest, capstone_model: Path, pieces_dir: Path):
    server = quiz_capstone.start(capstone_model, pieces_dir)
    request.config.stash[quiz_capstone.LOG] = server.log_path
    yield server
    server.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    check = item.get_closest_marker("capstone")
    if report.failed and check is not None:
        # a server that fails to start fails every check alike: say it once
        key, said = ("setup", START) if report.when == "setup" else (item.nodeid, check.args)
        item.config.stash[CHECKS_FAILED].setdefault(key, (*said, _observed(call)))
    where = learner_dir(item.config)
    if report.failed and where is not None and "exercise" in getattr(item, "fixturenames", ()):
        question = question_of(item)
        report.sections.append(("exercise", f"这个测试检查你的文件 {_shown(where, question)}"))
        failed = item.config.stash[FAILED].setdefault(question, [0, _observed(call)])
        failed[0] += 1
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    _capstone_summary(terminalreporter, config)
    where = learner_dir(config)
    failed = config.stash.get(FAILED, {})
    if where is None or not failed:
        return
    terminalreporter.section("测验：还没通过的题")
    for question in sorted(failed):
        count, observed = failed[question]
        terminalreporter.write_line(
            f"第 {question[1:]} 题：{count} 个测试没通过。要改的文件：{_shown(where, question)}"
        )
        terminalreporter.write_line(f"  看到的：{observed}")
        hint = _first_hint(where / QUESTIONS[question][0])
        if hint:
            terminalreporter.write_line(f"  提示：{hint}")
        terminalreporter.write_line(f"  再检查：pytest tests/quiz --learner -m {question}")


def _capstone_summary(terminalreporter, config: pytest.Config) -> None:
    failed = config.stash.get(CHECKS_FAILED, {})
    if not failed:
        return
    where = learner_dir(config) or SOLUTIONS
    terminalreporter.section("综合练习：还没通过的检查")
    for title, files, hint, observed in failed.values():
        terminalreporter.write_line(f"「{title}」没通过。")
        terminalreporter.write_line(f"  看到的：{observed}")
        shown = "、".join(str(_shown(where, q)) for q in files)
        terminalreporter.write_line(f"  可能要改的文件：{shown}")
        terminalreporter.write_line(f"  提示：{hint}")
    if quiz_capstone.LOG in config.stash:
        terminalreporter.write_line(f"服务器的日志：{config.stash[quiz_capstone.LOG]}")
    if where == EXERCISES:
        terminalreporter.write_line("再检查：pytest tests/quiz --learner --capstone")


def _shown(where: Path, question: str) -> Path:
    path = where / QUESTIONS[question][0]
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _observed(call: pytest.CallInfo) -> str:
    """What the failing test saw, in a line."""
    if call.excinfo is None:
        return "（测试没有说明）"
    if call.excinfo.errisinstance(NotImplementedError):
        return "还没有写：文件里还是练习的初始代码（NotImplementedError）"
    lines = str(call.excinfo.value).strip().splitlines()
    first = lines[0] if lines else call.excinfo.typename
    return first if len(first) <= 200 else first[:197] + "..."


def _first_hint(path: Path) -> str | None:
    """The first hint in the exercise file's docstring (the bullet after 提示 or Hints)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        return None
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().rstrip("：:") in ("提示", "Hints"):
            hint = []
            for more in lines[i + 1 :]:
                if hint and (more.startswith("- ") or not more.strip()):
                    break
                if more.startswith("- ") or hint:
                    hint.append(more.strip().removeprefix("- "))
            return " ".join(hint) or None
    return None
