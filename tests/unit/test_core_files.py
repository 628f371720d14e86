"""The lesson's core stays small and knows nothing of the features attached at its seams.

The files that the chapter's responsibility table ("要找的职责", the chapter's index page)
sends a reader to hold at most CORE_LINES lines together, and none of them imports the
request timelines, the metrics, the Responses API, the tool-call or reasoning parsers, or
grammar compilation and matching: those reach the core through its seams (observers,
routers, the parser registry, the tokenizer worker's preparation, the scheduler's
matchers). Read statically, with tests/unit/test_layers.py's import scanner.
"""

from __future__ import annotations

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
