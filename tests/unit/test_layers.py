"""The packages of minisgl import only downward: each has a layer, and an import from one
package into another must reach a strictly lower layer (within a package anything goes).

Read statically, with ast, so the check needs no import of torch or of the model: every
`import minisgl...` and `from minisgl... import` (relative ones resolved) counts, also the
ones inside functions (a lazy import up the layers is still one); only those under
`if TYPE_CHECKING:` do not, since they never run. A package or top-level module that has
no layer fails too, so a new one gets a place here before anything imports it.

`python tests/unit/test_layers.py` prints every cross-package import, package by package.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "minisgl"

# the layer of each package (or top-level module) of minisgl; an import must go lower
LAYERS: dict[str, int] = {
    # helpers that know nothing of minisgl: ZMQ, the msgpack codec, processes, staging;
    # the chat templates and the markers the tokenizer and the output parsers share
    "utils": 0,
    "templates": 0,
    "rules": 0,  # the request rules SamplingParams declares its fields with (core.py)
    # the observer hooks every component calls (metrics, timelines, the stall sweeper)
    "observe": 0,
    # the request types, tensor-parallel collectives, the page pool, grammar compilation
    "core": 1,
    "distributed": 1,
    "kvcache": 1,
    "grammar": 1,
    # the typed messages, the models and their loading, the attention backends
    "message": 2,
    "models": 2,
    "attention": 2,
    # one forward step, sampling, CUDA graphs
    "engine": 3,
    # the two workers: scheduling and (de)tokenization
    "scheduler": 4,
    "tokenizer": 4,
    # a tensor-parallel rank's process: an engine and a scheduler that follows rank 0
    "distributed_worker": 5,
    # what the server attaches to the components above at their seams: request timelines,
    # the output parsers (tool calls, reasoning)
    "timeline": 5,
    "parsers": 5,
    # the HTTP server and its launcher; the CUDA fast path's check
    "server": 6,
    "doctor": 6,
    # what users and tests drive: the shell, the offline API, the testing helpers
    "shell": 7,
    "llm": 7,
    "testing": 7,
    # `import minisgl` (LLM, SamplingParams), then `python -m minisgl` over it
    "__init__": 8,
    "__main__": 9,
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    line: int

    @property
    def source_package(self) -> str:
        return package_of(self.source)

    @property
    def target_package(self) -> str:
        return package_of(self.target)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def package_of(module: str) -> str:
    """`minisgl.engine.sample` -> `engine`; `minisgl.shell` -> `shell`; `minisgl` ->
    `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, dotted: str) -> bool:
    path = root.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes_that_run(tree: ast.AST):
    """Every node except those only under `if TYPE_CHECKING:` (its `else:` does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    source = module_name(path, root)
    # the package a relative import starts from: the module's own for an __init__.py
    here = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
    found = []
    for node in _nodes_that_run(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import triton_kernels` imports the module minisgl.attention.triton_kernels
            targets = [
                f"{module}.{alias.name}" if _is_module(root, f"{module}.{alias.name}") else module
                for alias in node.names
            ]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target == "minisgl" or target.startswith("minisgl."):
                found.append(Import(source, target, node.lineno))
    return sorted(found, key=lambda imp: imp.line)


def all_imports() -> list[Import]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in imports_of(path)]


def packages() -> set[str]:
    return {package_of(module_name(p)) for p in ROOT.rglob("*.py")}


def upward(imports: list[Import]) -> list[Import]:
    return [
        imp
        for imp in imports
        if imp.source_package != imp.target_package
        and LAYERS[imp.target_package] >= LAYERS[imp.source_package]
    ]


def test_every_package_has_a_layer() -> None:
    missing = sorted(packages() - LAYERS.keys())
    assert not missing, f"give these a layer in tests/unit/test_layers.py: {missing}"


def test_no_import_runs_up_the_layers() -> None:
    bad = upward(all_imports())
    assert not bad, "imports that reach a package at the same or a higher layer:\n" + "\n".join(
        f"  {imp}  ({imp.source_package} {LAYERS[imp.source_package]} -> "
        f"{imp.target_package} {LAYERS[imp.target_package]})"
        for imp in bad
    )


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The scanner itself: a lazy upward import is found, one under TYPE_CHECKING is not,
    and relative imports resolve to their package."""
    pkg = tmp_path / "minisgl" / "kvcache"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .pool import Pool\nfrom . import pool, allocator\n")
    (pkg / "pool.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..utils import zmq\n"
        "if TYPE_CHECKING:\n"
        "    from minisgl.engine import Engine\n"
        "def f():\n"
        "    from ..scheduler.cache import CacheManager\n"
        "    import minisgl.server.launch\n"
    )
    root = tmp_path / "minisgl"
    found = imports_of(pkg / "pool.py", root)
    assert [(i.target, i.line) for i in found] == [
        ("minisgl.utils", 2),
        ("minisgl.scheduler.cache", 6),
        ("minisgl.server.launch", 7),
    ]
    assert [i.target for i in imports_of(pkg / "__init__.py", root)] == [
        "minisgl.kvcache.pool",
        "minisgl.kvcache.pool",
        "minisgl.kvcache",  # not a module: a name from the package
    ]
    assert [i.target_package for i in upward(found)] == ["scheduler", "server"]


def main() -> None:
    by_package: dict[str, set[str]] = defaultdict(set)
    for imp in all_imports():
        if imp.source_package != imp.target_package:
            by_package[imp.source_package].add(imp.target_package)
    for pkg in sorted(LAYERS, key=lambda p: (LAYERS[p], p)):
        targets = ", ".join(
            f"{t} ({LAYERS.get(t, '?')})"
            for t in sorted(by_package.get(pkg, ()), key=lambda t: -LAYERS.get(t, 99))
        )
        print(f"{LAYERS[pkg]}  {pkg:20} -> {targets or '-'}")
    bad = upward(all_imports())
    for imp in bad:
        print(f"UPWARD: {imp}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
