"""The lesson's core stays small and knows nothing of the features attached at its seams;
the seams own the wiring and the building.

The files that the chapter's responsibility table ("要找的职责", the chapter's index page)
sends a reader to hold at most CORE_LINES lines together, and none of them imports the
request timelines, the metrics, the Responses API, the tool-call or reasoning parsers, or
grammar compilation and matching: those reach the core through its seams (observers,
routers, the parser registry, the tokenizer worker's preparation, the scheduler's
matchers). Read statically, with tests/unit/test_layers.py's import scanner.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layers import imports_of

ROOT = Path(__file__).resolve().parents[2]
TABLE_PAGE = ROOT / "chapters" / "http-and-concurrency" / "index.md"
CORE_LINES = 2000
# what the core may not import (a module, or a package and everything in it)
ATTACHED = (
    "minisgl.timeline",
    "minisgl.server.metrics",
    "minisgl.server.responses",
    "minisgl.parsers",
    "minisgl.grammar",
    "minisgl.engine.grammar",
    "minisgl.tokenizer.constraints",
    "minisgl.tokenizer.prepare",
)


def cited_files() -> list[Path]:
    """The `minisgl/....py` files the responsibility table names."""
    text = TABLE_PAGE.read_text()
    table = text[text.index("| 要找的职责 |") :].split("\n\n", 1)[0]
    return sorted({ROOT / m for m in re.findall(r"minisgl/[\w/]+\.py", table)})


def test_the_table_cites_the_lesson_s_files():
    names = {p.relative_to(ROOT).as_posix() for p in cited_files()}
    assert {"minisgl/server/frontend.py", "minisgl/tokenizer/server.py"} <= names
    assert all(p.is_file() for p in cited_files()), names


def test_the_cited_files_are_small_together():
    lines = {p.name: len(p.read_text().splitlines()) for p in cited_files()}
    assert sum(lines.values()) <= CORE_LINES, lines


def test_the_cited_files_import_nothing_attached_at_a_seam():
    bad = [
        str(imp)
        for path in cited_files()
        for imp in imports_of(path)
        if any(imp.target == a or imp.target.startswith(a + ".") for a in ATTACHED)
    ]
    assert not bad, "\n".join(bad)


def _function_lines(path: Path, qualname: str) -> int:
    """Lines of the function `qualname` ("Class.method" or "function") in `path`."""
    tree = ast.parse(path.read_text())
    owner, _, name = qualname.rpartition(".")
    scope = tree.body
    if owner:
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
        scope = cls.body
    (fn,) = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn.end_lineno - fn.lineno + 1


def test_the_seams_own_wiring_and_building_stays_small():
    """create_app only wires; Engine.__init__ only loads, sizes and allocates."""
    assert _function_lines(ROOT / "minisgl/server/api_server.py", "create_app") <= 60
    assert _function_lines(ROOT / "minisgl/engine/engine.py", "Engine.__init__") <= 45


def test_only_the_step_loop_of_the_scheduler_knows_the_engine_and_the_models():
    knows = {
        path.name
        for path in (ROOT / "minisgl/scheduler").glob("*.py")
        for imp in imports_of(path)
        if imp.target_package in ("engine", "models")
    }
    assert knows == {"scheduler.py"}


def test_production_never_imports_the_fault_injection():
    assert not (ROOT / "minisgl/engine/faults.py").exists()
    for path in (ROOT / "minisgl").rglob("*.py"):
        assert "faults" not in {imp.target.rsplit(".", 1)[-1] for imp in imports_of(path)}, path
