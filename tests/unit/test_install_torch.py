"""scripts/install_torch.py, the Makefile's first step: which torch build from which index.

Run as the Makefile runs it, in a Python without torch (`-S -I`: no site-packages), with a
fake `pip` (MINISGL_PIP: records each call, writes a dry-run report, fails where told) and a
fake `nvidia-smi` on PATH; nothing is installed. Checked: a GPU takes the default index's
CUDA build; Linux without one the CPU build from the CPU wheel index, or, where that index
cannot be reached or pip fails there, the default index, saying so in one line with the
download size (not estimated under CI); macOS the default index.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

linux = pytest.mark.skipif(platform.system() != "Linux", reason="the CPU index is Linux's")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_torch.py"

FAKE_PIP = """#!/bin/sh
echo "$*" >> "$PIP_LOG"
case "$*" in
  *--dry-run*)
    report=$(echo "$*" | sed 's/.*--report \\([^ ]*\\).*/\\1/')
    printf '{"install": [{"download_info": {"url": "file://%s"}}, \
{"download_info": {"url": "file://%s"}}]}' "$WHEEL" "$WHEEL" > "$report" ;;
  *--index-url*) exit "${PIP_INDEX_FAILS:-0}" ;;
esac
"""


def _load():
    spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fakes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pip = bin_dir / "pip"
    pip.write_text(FAKE_PIP)
    wheel = tmp_path / "torch.whl"
    wheel.write_bytes(b"\0" * 3_000_000)  # two of it: 6 MB
    index = tmp_path / "cpu-index"
    (index / "torch").mkdir(parents=True)
    (index / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(index))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # an index that answers
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pip.chmod(0o755)
    log = tmp_path / "pip.log"

    def run(gpu: bool | None = None, index: str | None = None, index_fails=False, ci=False):
        if gpu is not None:
            smi = bin_dir / "nvidia-smi"
            smi.write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")
            smi.chmod(0o755)
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "MINISGL_PIP": str(pip),
            "MINISGL_TORCH_CPU_INDEX": index or index_uri,
            "PIP_LOG": str(log),
            "WHEEL": str(wheel),
            "PIP_INDEX_FAILS": "1" if index_fails else "0",
            **({"CI": "true"} if ci else {}),
        }
        done = subprocess.run([sys.executable, "-S", "-I", str(SCRIPT)], env=env, text=True,
                              capture_output=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        installs = [c for c in calls if "--dry-run" not in c]
        return done.stdout.strip().splitlines(), installs, len(calls) - len(installs)

    index_uri = f"http://127.0.0.1:{server.server_address[1]}/"
    yield run, index_uri
    server.shutdown()
    server.server_close()


@linux
def test_linux_without_a_gpu_takes_the_cpu_index(fakes) -> None:
    run, index = fakes
    lines, installs, dry_runs = run(gpu=False)
    assert dry_runs == 1  # the estimate, before the install
    assert lines == [f"installing torch==2.13.0 from the CPU wheel index {index}: "
                     "6 MB to fetch (2 files)"]  # fmt: skip
    assert installs == [f"install -q --index-url {index} torch==2.13.0"]


@linux
def test_an_unreachable_cpu_index_falls_back_to_the_default_index_at_once(fakes) -> None:
    run, _ = fakes
    closed = "http://127.0.0.1:9"  # the discard port: nothing listens, refused at once
    lines, installs, _ = run(index=closed)  # no nvidia-smi at all
    assert len(lines) == 1
    assert lines[0].startswith(f"the CPU wheel index {closed} cannot be reached (")
    assert lines[0].endswith(
        ": installing torch==2.13.0 from pip's default index: 6 MB to fetch (2 files)"
    )
    assert installs == ["install -q torch==2.13.0"]


@linux
def test_pip_failing_at_the_cpu_index_retries_the_default_index(fakes) -> None:
    run, index = fakes
    lines, installs, _ = run(index_fails=True)
    assert lines[1] == f"pip could not install from the CPU wheel index {index}: " + (
        "trying pip's default index"
    )
    assert installs == [f"install -q --index-url {index} torch==2.13.0", "install -q torch==2.13.0"]


@linux
def test_ci_skips_the_download_estimate(fakes) -> None:
    run, index = fakes
    lines, installs, dry_runs = run(ci=True)
    assert dry_runs == 0
    assert lines == [f"installing torch==2.13.0 from the CPU wheel index {index}: "
                     "download size not estimated"]  # fmt: skip
    assert installs == [f"install -q --index-url {index} torch==2.13.0"]


def test_a_visible_gpu_takes_the_default_index_cuda_build(fakes) -> None:
    run, _ = fakes
    lines, installs, _ = run(gpu=True)
    assert lines == ["an NVIDIA GPU is visible: the CUDA build: installing torch from pip's "
                     "default index: 6 MB to fetch (2 files)"]  # fmt: skip
    assert installs == ["install -q torch"]


def test_macos_keeps_the_default_index_without_asking_the_cpu_index() -> None:
    script = _load()
    asked = []
    plan = script.plan("Darwin", False, script.CPU_INDEX, reach=asked.append)
    assert asked == [] and plan.index_args == [] and plan.requirement == "torch==2.13.0"
    assert script.describe(plan, None) == (
        "Darwin: its wheels are CPU builds: installing torch==2.13.0 from pip's default "
        "index: download size not estimated"
    )


def test_nothing_is_installed_where_torch_imports(tmp_path) -> None:
    log = tmp_path / "pip.log"
    env = dict(os.environ, MINISGL_PIP=f"sh -c 'echo called >> {log}'")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "" and not log.exists()
