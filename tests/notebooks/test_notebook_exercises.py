"""The notebooks' exercises (练习) are checked cells, proved both ways, like the quiz.

Each notebook has at least one exercise: a code cell tagged `exercise` that defines one
name with a stub body, followed by a cell tagged `check` that is exactly
`await checks.CHECK(NAME)` (notebooks/checks.py). For every such pair:
- the exercise cell as committed, run on its own (it must import what it uses), fails
  its check, and the failure says that the exercise is still to be written;
- the reference solution (tests/notebooks/solutions/<notebook>.py, which defines NAME)
  passes the same check;
- the check's `verdict` is what the notebook cell prints: a failure is a message in the
  notebook's language (Chinese), not a bare assertion.
The answers stay out of the notebooks: the solutions live here, beside this test.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = Path(__file__).resolve().parent / "solutions"
CHECK_CELL = re.compile(r"await checks\.([a-z_]+)\(([A-Za-z_]+)\)")
HAN = re.compile(r"[\u4e00-\u9fff]")


def exercises() -> list[tuple[str, int, str, str, str]]:
    """(notebook, cell index, exercise source, check name, answer name) for each pair."""
    found = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if "exercise" not in cell.get("metadata", {}).get("tags", []):
                continue
            assert i + 1 < len(cells), f"{path.name}: an exercise cell with no check after it"
            check = cells[i + 1]
            assert "check" in check.get("metadata", {}).get("tags", []), (
                f"{path.name} cell {i + 1}: the cell after an exercise must be its check"
            )
            m = CHECK_CELL.fullmatch("".join(check["source"]).strip())
            assert m, f"{path.name} cell {i + 1}: a check cell is `await checks.NAME(ANSWER)`"
            found.append((path.stem, i, "".join(cell["source"]), m[1], m[2]))
    return found


def solution(notebook: str):
    path = SOLUTIONS / f"{notebook}.py"
    spec = importlib.util.spec_from_file_location(f"notebook_solution_{notebook[:2]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(name: str):
    import checks  # notebooks/ is on the path (pyproject: pythonpath)

    return getattr(checks, name)


EXERCISES = exercises()


def test_every_notebook_has_a_checked_exercise():
    with_one = {notebook for notebook, *_ in EXERCISES}
    every = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    assert with_one == every, f"no checked exercise in {sorted(every - with_one)}"
    assert {f"{n}.py" for n in every} == {p.name for p in SOLUTIONS.glob("*.py")}


@pytest.mark.parametrize(
    ("notebook", "cell", "source", "name", "answer"),
    EXERCISES,
    ids=[f"{n}-cell{i}" for n, i, *_ in EXERCISES],
)
async def test_the_stub_fails_and_the_solution_passes(notebook, cell, source, name, answer):
    namespace: dict = {}
    exec(compile(source, f"{notebook} cell {cell}", "exec"), namespace)  # the cell on its own
    assert answer in namespace, f"{notebook} cell {cell} does not define {answer}"
    failure = await check(name).verdict(namespace[answer])
    assert failure is not None, f"{notebook}: the committed stub passes its check"
    assert "还没写" in failure, f"{notebook}: the stub fails for another reason: {failure}"

    passed = await check(name).verdict(getattr(solution(notebook), answer))
    assert passed is None, f"{notebook}: the reference solution fails its check: {passed}"


WRONG = {  # a plausible wrong answer per check: it fails, saying so in Chinese
    "end_the_stuck_request": "async def f(task):\n    task.cancel()\n",
    "finally_manager": (
        "from naive import RefStyleManager\n\nclass f(RefStyleManager):\n    pass\n"
    ),
    "sse_text": (
        "import json\n\ndef f(lines):\n    return ''.join(json.loads(l[6:])['choices'][0]"
        "['delta'].get('content') or '' for l in lines if l.startswith('data: {'))\n"
    ),
    "all_released": "def f(state):\n    return not any(state['scheduler'].values())\n",
    "replies_that_fit": "def f(cap, size):\n    return cap // size + 1\n",
    "cached_on_repeat": "def f(n, page):\n    return n // page * page\n",
    "end_order": "def f(t):\n    return [e['process'] for e in t['events'][:3]]\n",
}


@pytest.mark.parametrize("name", sorted({name for *_, name, _ in EXERCISES}))
async def test_a_wrong_answer_fails_with_a_message_in_the_notebooks_language(name):
    namespace: dict = {}
    exec(WRONG[name], namespace)
    failure = await check(name).verdict(namespace["f"])
    assert failure is not None, f"{name}: a wrong answer passes"
    assert HAN.search(failure), f"{name}: the failure is not in Chinese: {failure}"
