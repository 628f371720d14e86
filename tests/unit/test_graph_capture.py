"""A decode-graph capture that fails mid-way leaves the caller's CUDA stream current and no
half-captured graph behind (engine/graph.py).

No GPU here: torch.cuda's stream and graph calls are replaced by a stand-in that keeps the
one piece of state at stake, the current stream, and fails as torch does. torch.cuda.graph
makes its side stream current on entry and restores the caller's only after
`capture_end()`; when the captured step raises, `capture_end()` raises as well (the
capture was invalidated), so the restore is skipped.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from minisgl.engine.graph import DecodeGraphRunner


class FakeCuda:
    """The current stream of one thread, and graph captures that fail on request."""

    def __init__(self, fail_at_bs: int) -> None:
        self.default = "default stream"
        self.current = self.default
        self.fail_at_bs = fail_at_bs
        self.capturing = False

    def Stream(self):  # noqa: N802 (torch's name)
        return SimpleNamespace(wait_stream=lambda other: None, name="side stream")

    def current_stream(self):
        return SimpleNamespace(wait_stream=lambda other: None, stream=self.current)

    def set_stream(self, stream) -> None:
        self.current = stream.stream if hasattr(stream, "stream") else stream

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s.name
        try:
            yield
        finally:
            self.current = before

    def CUDAGraph(self):  # noqa: N802
        return SimpleNamespace(pool=lambda: "pool")

    def graph(self, g, pool=None):
        fake = self

        class Capture:  # the order of torch.cuda.graph's __enter__ and __exit__
            def __enter__(self):
                self.before, fake.current = fake.current, "capture stream"
                fake.capturing = True

            def __exit__(self, exc_type, *rest):
                fake.capturing = False
                if exc_type is not None:  # capture_end() of an invalidated capture
                    raise RuntimeError("CUDA error: operation failed due to a previous error "
                                       "during capture")  # fmt: skip
                fake.current = self.before

        return Capture()

    def forward(self, bs: int) -> None:
        if self.capturing and bs == self.fail_at_bs:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def _runner(monkeypatch, fake: FakeCuda) -> DecodeGraphRunner:
    for name in ("Stream", "current_stream", "set_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runner = DecodeGraphRunner.__new__(DecodeGraphRunner)  # only what capture() touches
    runner.buckets = [1, 2, 4]
    runner.graphs = {}
    runner.records = True  # as on a CUDA device
    runner.buffers = SimpleNamespace(input_ids=SimpleNamespace(device=torch.device("cuda")))
    runner._forward = fake.forward
    return runner


def test_a_capture_that_fails_mid_way_restores_the_caller_s_stream(monkeypatch) -> None:
    fake = FakeCuda(fail_at_bs=2)  # bucket 4 is captured first, then 2 fails
    runner = _runner(monkeypatch, fake)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        runner.capture()
    assert fake.current == fake.default  # not the capture stream
    assert runner.graphs == {}  # bucket 4's graph is not replayed either


def test_a_capture_that_succeeds_keeps_every_bucket_on_the_caller_s_stream(monkeypatch) -> None:
    fake = FakeCuda(fail_at_bs=0)
    runner = _runner(monkeypatch, fake)
    runner.capture()
    assert fake.current == fake.default
    assert sorted(runner.graphs) == [1, 2, 4]
