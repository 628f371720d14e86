"""The quiz material itself: untouched exercises fail, the solutions pass in their place,
each faulty design the chapter warns about fails its question, and none needs torch.

Runs of the quiz as a learner runs it (`--learner-dir`, in a subprocess in which
`import torch` raises ImportError before pytest starts), side by side:
- the exercise files as committed, copied to a temporary folder: every question q1..q7
  has a failing test, and every failure is its question's stub saying which file to edit;
- the reference solutions copied to a temporary folder: every test passes, and they are
  the same tests as in the first run;
- the faulty designs of tests/quiz/faulty/ (`quiz_material.FAULTY`), each in its
  question's place among the solutions (a few runs, at most one design per question in
  each, only those questions' tests): each design fails a test of its question, and a
  failure says, in the chapter's words, what that design gets wrong.
Besides: each exercise file and each faulty design has the public names and signatures
of its solution, and chapters/quiz.md quotes each solution in its question's answer box.

A learner's run (`--learner`) does not collect this file: it checks the material, and the
learner's edited exercises would fail the first run by design.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from quiz_material import EXERCISES, FAULTY, FAULTY_DIR, QUESTIONS, ROOT, SOLUTIONS, load

# run pytest in a fresh interpreter where torch cannot be imported, as on a machine
# without it (the finder refuses it before the installed one could be found)
WITHOUT_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("torch is blocked for this run", name="torch")
        return None

sys.meta_path.insert(0, NoTorch())
try:
    import torch
except ImportError:
    pass
else:
    sys.exit("torch could still be imported")
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""
pytestmark = pytest.mark.timeout(900)  # several runs of the quiz

EDITED = (
    "（这里检查的是提交时的练习文件；如果你已经改过它们，请改用"
    " `pytest tests/quiz --learner` 检查你的答案）"
)
# plugins that the quiz does not use: leaving them out only saves start-up time
UNUSED_PLUGINS = ["-p", "no:nbmake", "-p", "no:hypothesispytest", "-p", "no:schemathesis"]


@dataclass
class Run:
    returncode: int
    output: str
    results: dict[str, str | None]  # test id -> None if it passed, else the failure message
    skipped: list[str]


def start_as_learner(
    files: Path, workdir: Path, replace: dict[str, Path] | None = None, only: str | None = None
) -> tuple[subprocess.Popen, Path]:
    """Start the quiz on a copy of `files` (with the files of `replace` put in place of
    theirs: exercise file name -> file), without torch; `only`: a marker expression."""
    learner = workdir / "learner"
    shutil.copytree(files, learner, ignore=shutil.ignore_patterns("__pycache__"))
    for name, source in (replace or {}).items():
        shutil.copyfile(source, learner / name)
    args = ["tests/quiz", "--learner-dir", str(learner), f"--junitxml={workdir / 'report.xml'}"]
    if only:
        args += ["-m", only]
    with open(workdir / "output.txt", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, "-c", WITHOUT_TORCH, *args, "-q", "-p", "no:cacheprovider"]
            + UNUSED_PLUGINS,
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return proc, workdir


def finish(proc: subprocess.Popen, workdir: Path) -> Run:
    proc.wait(timeout=600)
    output, report = (workdir / "output.txt").read_text(), workdir / "report.xml"
    assert report.exists(), output[-3000:]
    results, skipped = {}, []
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if case.find("skipped") is not None:
            skipped.append(test_id)
        results[test_id] = None if problem is None else problem.get("message", "")
    return Run(proc.returncode, output, results, skipped)


def faulty_rounds() -> list[dict[str, str]]:
    """The faulty designs in rounds: round k holds the k-th design of each question
    (question -> design file), so one run checks several questions' designs at once."""
    rounds: list[dict[str, str]] = []
    for design, (question, _) in FAULTY.items():
        spot = next((r for r in rounds if question not in r), None)
        if spot is None:
            rounds.append(spot := {})
        spot[question] = design
    return rounds


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """The quiz run on the untouched exercises, on the solutions and on the faulty designs
    (in the solutions' place), side by side; keys "stubs", "solutions", "faulty-0", ..."""
    started = {
        name: start_as_learner(files, tmp_path_factory.mktemp(name))
        for name, files in (("stubs", EXERCISES), ("solutions", SOLUTIONS))
    }
    for k, designs in enumerate(faulty_rounds()):
        replace = {QUESTIONS[q][0]: FAULTY_DIR / design for q, design in designs.items()}
        only = " or ".join(sorted(designs))
        started[f"faulty-{k}"] = start_as_learner(
            SOLUTIONS, tmp_path_factory.mktemp(f"faulty-{k}"), replace, only
        )
    try:
        return {name: finish(*run) for name, run in started.items()}
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def question_of(test_id: str) -> str:
    match = re.search(r"test_(q\d)_", test_id)
    assert match, f"{test_id} is not in a test_qN_ module"
    return match[1]


def test_untouched_exercises_fail_and_every_failure_names_its_file(runs):
    stubs_run = runs["stubs"]
    assert stubs_run.returncode == 1, stubs_run.output[-3000:]  # tests failed; no crash
    failed = {test_id: msg for test_id, msg in stubs_run.results.items() if msg is not None}
    for question, (filename, _) in QUESTIONS.items():
        mine = [msg for test_id, msg in failed.items() if question_of(test_id) == question]
        assert mine, f"{question} 没有一个测试在 tests/quiz/exercises/{filename} 上失败{EDITED}"
    for test_id, msg in failed.items():
        filename = QUESTIONS[question_of(test_id)][0]
        assert f"编辑 tests/quiz/exercises/{filename}" in msg, (
            f"{test_id} 失败了，却没有说出要编辑的文件{EDITED}：{msg}"
        )


def test_the_solutions_in_a_learners_place_pass_every_test(runs):
    solutions_run, stubs_run = runs["solutions"], runs["stubs"]
    failed = {t: m for t, m in solutions_run.results.items() if m is not None}
    assert not failed, solutions_run.output[-3000:]
    assert solutions_run.returncode == 0 and not solutions_run.skipped
    assert set(solutions_run.results) == set(stubs_run.results)  # the same tests
    assert {question_of(t) for t in solutions_run.results} == set(QUESTIONS)


def test_each_faulty_design_fails_its_question_saying_what_is_wrong(runs):
    checked = set()
    for k, designs in enumerate(faulty_rounds()):
        run = runs[f"faulty-{k}"]
        assert run.results, run.output[-3000:]
        assert "torch is blocked" not in run.output, run.output[-3000:]
        for question, design in designs.items():
            words = FAULTY[design][1]
            failures = [
                msg
                for test_id, msg in run.results.items()
                if question_of(test_id) == question and msg is not None
            ]
            assert failures, f"faulty design {design} passes every test of {question}"
            assert any(words in msg for msg in failures), (
                f"faulty design {design} fails {question}, but no failure says {words!r}:\n"
                + "\n".join(failures)
            )
            checked.add(design)
    assert checked == set(FAULTY)


def test_the_quiz_runs_without_torch(runs):
    # both runs refused `import torch`, and every test passed on the solutions
    for run in runs.values():
        assert "torch could still be imported" not in run.output
        assert "torch is blocked" not in run.output, run.output[-3000:]
    assert runs["solutions"].returncode == 0, runs["solutions"].output[-3000:]


def public_interface(module) -> dict[str, str]:
    """The functions and classes a module defines (methods included), with signatures."""
    found = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found[name] = "class"
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and (attr == "__init__" or attr[0] != "_"):
                    found[f"{name}.{attr}"] = str(inspect.signature(member))
        elif inspect.isfunction(obj):
            found[name] = str(inspect.signature(obj))
    return found


@pytest.mark.parametrize("question", QUESTIONS)
def test_each_exercise_has_the_interface_of_its_solution(question):
    filename = QUESTIONS[question][0]
    exercise = public_interface(load(EXERCISES / filename))
    solution = public_interface(load(SOLUTIONS / filename))
    assert exercise, f"{filename} defines nothing to write"
    assert {name: solution.get(name) for name in exercise} == exercise


@pytest.mark.parametrize("design", FAULTY)
def test_each_faulty_design_has_the_interface_of_its_solution(design):
    question = FAULTY[design][0]
    faulty = public_interface(load(FAULTY_DIR / design))
    solution = public_interface(load(SOLUTIONS / QUESTIONS[question][0]))
    assert faulty, f"{design} defines nothing"
    assert {name: solution.get(name) for name in faulty} == faulty


@pytest.mark.parametrize("question", QUESTIONS)
def test_each_solution_is_quoted_in_its_answer_box_in_the_quiz_page(question):
    page = (ROOT / "chapters" / "quiz.md").read_text()
    sections = re.split(r"^## ", page, flags=re.M)
    (section,) = [s for s in sections if f"{{#{question}}}" in s.splitlines()[0]]
    filename = QUESTIONS[question][0]
    assert f"tests/quiz/exercises/{filename}" in section  # the learner is told what to edit
    box = section[section.index('??? success "') :]
    snippet = f'--8<-- "tests/quiz/solutions/{filename}"'
    assert re.search(rf"^ {{4}}{re.escape(snippet)}$", box, flags=re.M), (
        f"the answer box of {question} does not quote {filename} in its code block"
    )
