"""The `gpu` tests collect, and skip cleanly without a GPU, with only the packages of the
lent GPU machine (torch, triton, transformers, pytest; msgspec carried as a wheel).

That machine has none of the server's packages: FastAPI, uvicorn, pydantic, pyzmq, the
openai client, gguf, llguidance. `pytest -m gpu tests/unit` imports every test module
before it deselects, and stops at the first that needs one of them; so
benchmarks/first_contact.py names the files that hold `gpu` tests instead. Here pytest
runs in a subprocess where those packages cannot be imported (a meta-path finder installed
by a sitecustomize module), with no plugins but pytest's own (that machine has neither
pytest-asyncio nor nbmake): the named files collect every `gpu` test that a collection of
all of tests/unit finds with every package present, and run to a clean skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_ON_THE_GPU_MACHINE = ("fastapi", "uvicorn", "pydantic", "starlette", "zmq", "openai",
                          "gguf", "llguidance")  # fmt: skip
BLOCKER = f"""
import importlib.abc, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {NOT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine)")

sys.meta_path.insert(0, NotInstalled())
"""


def _pytest(args: list[str], site: Path | None) -> subprocess.CompletedProcess:
    path = [str(ROOT)] + ([str(site)] if site else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if site:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def _ids(out: str) -> set[str]:
    return {line for line in out.splitlines() if re.match(r"tests/unit/\S+\.py::", line)}


def test_the_gpu_tests_collect_and_skip_with_only_the_gpu_machine_s_packages(tmp_path) -> None:
    import first_contact

    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    files = [str(p.relative_to(ROOT)) for p in first_contact.gpu_test_files()]

    # the blocker works: collecting all of tests/unit stops, as on the GPU machine
    everything = _pytest(["--collect-only", "-q", "-m", "gpu", "tests/unit"], tmp_path)
    assert everything.returncode != 0
    assert "errors during collection" in everything.stdout
    assert "(not on the GPU machine)" in everything.stdout

    named = _pytest(["-v", "-m", "gpu", *files], tmp_path)
    assert named.returncode == 0, named.stdout[-3000:] + named.stderr[-3000:]
    assert "ERROR" not in named.stdout and "errors during collection" not in named.stdout
    summary = named.stdout.strip().splitlines()[-1]
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert "passed" not in summary and "failed" not in summary

    # every gpu test there is, as a collection of all of tests/unit with every package finds
    full = _pytest(["--collect-only", "-q", "-m", "gpu", "tests/unit"], None)
    assert full.returncode == 0, full.stdout[-3000:]
    expected = _ids(full.stdout)
    assert len(expected) >= 13
    ran = {line.split(" ")[0] for line in named.stdout.splitlines() if " SKIPPED" in line}
    assert ran == expected and skipped == len(expected)
