"""The capstone itself (test_capstone.py), run as a learner runs it, on three folders side
by side, each with a real server of its own (the tiny model built once, for all three):
- the reference solutions: every check passes;
- the solutions with one faulty design in its question's place,
  q7_cleanup_after_the_yield.py (cleanup after the `yield`, without `finally`): the
  answers still arrive whole, but a client that leaves mid-answer leaves its state in the
  frontend for good, and both checks of a leaving client say /debug/lifecycle is not back
  at zero, naming q7's file;
- the exercise files as committed (stubs): every check fails, and the summary says the
  code is not written yet.
This needs torch (the server does): without it, it skips.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from quiz_material import EXERCISES, FAULTY_DIR, QUESTIONS, ROOT, SOLUTIONS

from minisgl.server.quiz_pieces import FILES

pytestmark = pytest.mark.timeout(600)

FAULTY_Q7 = "q7_cleanup_after_the_yield.py"
LEAVING = ("test_a_client_leaving_mid_stream", "test_a_client_leaving_a_whole_answer")
CHECKS = 6


def _start(files: Path, workdir: Path, model: Path, replace: dict[str, Path]):
    learner = workdir / "learner"
    shutil.copytree(files, learner, ignore=shutil.ignore_patterns("__pycache__"))
    for name, source in replace.items():
        shutil.copyfile(source, learner / name)
    args = ["tests/quiz", "--capstone", "--learner-dir", str(learner)]
    args += ["--capstone-model", str(model), f"--junitxml={workdir / 'report.xml'}"]
    output = open(workdir / "output.txt", "w")  # noqa: SIM115 - closed with the run
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT), output


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, str, dict[str, str | None]]]:
    """name -> (exit status, output, test name -> None if it passed, else its message)."""
    pytest.importorskip("torch")
    from quiz_capstone import tiny_model

    model = tiny_model(tmp_path_factory.mktemp("capstone-model"))
    variants = {
        "solutions": (SOLUTIONS, {}),
        "faulty": (SOLUTIONS, {QUESTIONS["q7"][0]: FAULTY_DIR / FAULTY_Q7}),
        "stubs": (EXERCISES, {}),
    }
    started = {}
    for name, (files, replace) in variants.items():
        workdir = tmp_path_factory.mktemp(name)
        started[name] = (workdir, *_start(files, workdir, model, replace))
    results = {}
    try:
        for name, (workdir, proc, output) in started.items():
            proc.wait(timeout=500)
            output.close()
            text = (workdir / "output.txt").read_text()
            assert (workdir / "report.xml").exists(), text[-3000:]
            tests: dict[str, str | None] = {}
            for case in ET.parse(workdir / "report.xml").iter("testcase"):
                problems = [case.find("failure"), case.find("error")]
                problem = next((p for p in problems if p is not None), None)
                # a test both failed and errored at teardown keeps its first message
                tests.setdefault(
                    case.get("name"), None if problem is None else problem.get("message", "")
                )
            results[name] = (proc.returncode, text, tests)
    finally:
        for _, proc, output in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            output.close()
    return results


def test_the_capstone_passes_with_the_reference_solutions(runs):
    code, output, tests = runs["solutions"]
    assert code == 0 and len(tests) == CHECKS, output[-3000:]
    assert all(message is None for message in tests.values()), output[-3000:]


def test_a_scope_that_cleans_up_after_the_yield_leaves_state_behind(runs):
    code, output, tests = runs["faulty"]
    assert code == 1 and len(tests) == CHECKS, output[-3000:]
    failed = {name for name, message in tests.items() if message is not None}
    assert failed == {n for n in tests if n.startswith(LEAVING)}, output[-3000:]
    for name in failed:
        assert "/debug/lifecycle 还没有回到零：frontend.requests=" in tests[name], tests[name]
    assert output.count("「") == len(LEAVING), output[-3000:]  # one message per failed check
    assert f"/learner/{QUESTIONS['q7'][0]}" in output.split("综合练习：还没通过的检查")[1]


def test_the_untouched_stubs_fail_every_check(runs):
    code, output, tests = runs["stubs"]
    assert code == 1 and len(tests) == CHECKS, output[-3000:]
    assert all(message is not None for message in tests.values()), output[-3000:]
    summary = output.split("综合练习：还没通过的检查")[1]
    assert "还没有写" in summary and "服务器的日志：" in summary, summary
    assert "Traceback" not in output, output[-3000:]


def test_the_server_loads_the_files_the_quiz_names():
    assert FILES == {q: QUESTIONS[q][0] for q in FILES}
    assert set(FILES) == {"q3", "q4", "q5", "q6", "q7"}
