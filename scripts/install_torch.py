"""Install torch into the running Python's environment, the build this machine can use.

Run by the Makefile with the virtual environment's Python, before the project itself
(a bare `torch` requirement would take whatever pip's default index gives). Nothing happens
where torch is importable already. Otherwise, in one line, it says which build it installs
from where and how much that downloads (pip's own dry run resolves the files: their sizes
are summed from the file system for local ones and from a HEAD request for the others):
- an NVIDIA GPU visible (`nvidia-smi -L` succeeds): torch from pip's default index, the
  CUDA build;
- Linux without one: the CPU build from PyTorch's CPU wheel index (CPU_INDEX), about 200 MB,
  where pip's default index would pull the CUDA build and several GB of NVIDIA libraries.
  Where that index cannot be reached (probed first, a few seconds at most) or pip fails
  there, pip's default index instead, saying so;
- macOS and the rest: pip's default index (macOS wheels are CPU builds).

Environment: MINISGL_PIP, the pip command (default: this Python's `-m pip`);
MINISGL_TORCH_CPU_INDEX, the CPU wheel index (both for tests and unusual set-ups); CI set:
no download estimate (its dry run resolves everything once more, a few seconds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH = "torch==2.13.0"  # the build the project is tested with on CPUs
PROBE_TIMEOUT_S = 5.0


@dataclass
class Plan:
    """What to install from where, and the words for it."""

    requirement: str
    index_args: list[str] = field(default_factory=list)
    source: str = "pip's default index"
    note: str = ""  # why this source, where it is not the first choice


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when `url` answers; else why not, in a few words."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def plan(system: str, gpu: bool, cpu_index: str, reach=probe) -> Plan:
    """The build for a machine running `system` (platform.system()) with or without an
    NVIDIA GPU; `reach(cpu_index)` -> None when the CPU wheel index answers, else why not."""
    if gpu:
        return Plan("torch", note="an NVIDIA GPU is visible: the CUDA build")
    if system != "Linux":
        return Plan(CPU_TORCH, note=f"{system}: its wheels are CPU builds")
    why = reach(cpu_index)
    if why is None:
        return Plan(CPU_TORCH, ["--index-url", cpu_index], f"the CPU wheel index {cpu_index}")
    return Plan(CPU_TORCH, note=f"the CPU wheel index {cpu_index} cannot be reached ({why})")


def download_bytes(pip: list[str], plan: Plan) -> tuple[int, int] | None:
    """(bytes, files) that installing `plan` downloads, from pip's dry run; None if unknown."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [*pip, "install", "-q", "--dry-run", "--report", str(report)]
        try:
            subprocess.run([*cmd, *plan.index_args, plan.requirement], check=True,
                           capture_output=True, timeout=300)  # fmt: skip
            items = json.loads(report.read_text())["install"]
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            return None
    sizes = [_size(item["download_info"]["url"]) for item in items]
    if not sizes or None in sizes:
        return None
    return sum(sizes), len(sizes)


def _size(url: str) -> int | None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        try:
            return os.path.getsize(urllib.parse.unquote(parsed.path))
        except OSError:
            return None
    try:
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=PROBE_TIMEOUT_S) as reply:
            return int(reply.headers["Content-Length"])
    except (urllib.error.URLError, OSError, ValueError, TypeError):
        return None


def describe(plan: Plan, download: tuple[int, int] | None) -> str:
    """The one line said before installing."""
    size = (
        f"{download[0] / 1e6:,.0f} MB to fetch ({download[1]} files)"
        if download is not None
        else "download size not estimated"
    )
    line = f"installing {plan.requirement} from {plan.source}: {size}"
    return f"{plan.note}: {line}" if plan.note else line


def main() -> int:
    if importlib.util.find_spec("torch") is not None:
        return 0
    pip = shlex.split(os.environ.get("MINISGL_PIP", "")) or [sys.executable, "-m", "pip"]
    cpu_index = os.environ.get("MINISGL_TORCH_CPU_INDEX", CPU_INDEX)
    chosen = plan(platform.system(), has_nvidia_gpu(), cpu_index)
    # the estimate costs a resolution of its own (seconds): CI's fresh clones skip it
    download = None if os.environ.get("CI") else download_bytes(pip, chosen)
    print(describe(chosen, download), flush=True)
    done = subprocess.run([*pip, "install", "-q", *chosen.index_args, chosen.requirement])
    if done.returncode and chosen.index_args:  # reached, but pip could not install from it
        print(f"pip could not install from {chosen.source}: trying pip's default index", flush=True)
        done = subprocess.run([*pip, "install", "-q", chosen.requirement])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
