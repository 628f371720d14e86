"""Shared fixtures: tiny checkpoints per family (built once per session) and markers.

torch is imported only where it is used: the quiz (tests/quiz) runs without it."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). This must be
# set before any kernel is defined, so here, before anything imports them.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3"]
QUIZ = Path(__file__).resolve().parent / "quiz"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    from tiny import make_checkpoint

    return {a: make_checkpoint(a, tmp_path_factory.mktemp(f"tiny-{a}")) for a in ARCHS}


@pytest.fixture(scope="session", autouse=True)
def _quiet_threads(request):
    # a session of quiz tests alone never imports torch
    if all(QUIZ in Path(item.path).resolve().parents for item in request.session.items):
        return
    import torch

    # two cores: keep torch from oversubscribing when tests start subprocesses
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def split_halves(monkeypatch, request) -> list[int]:
    """Every split of minisgl.utils.split taken, however small the work (the tests' tiny
    layers), and the shape of each half's result recorded in the list returned, in no set
    order.
    Torch computes on one thread meanwhile, as where the split runs (an engine made earlier
    in this process may have left it on more: minisgl.engine.threads)."""
    import torch

    from minisgl.utils import split

    halves: list[int] = []
    real = split._half
    monkeypatch.setattr(split, "SPLIT_WORK", 0)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(old_threads))

    def recorded(fn, xs, *a):
        out = real(fn, xs, *a)
        halves.append(tuple(out.shape))
        return out

    monkeypatch.setattr(split, "_half", recorded)
    return halves
