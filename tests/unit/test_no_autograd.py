"""Serving records no autograd history: no activation outlives its step.

A forward run with autograd on, over parameters that require grad, leaves its output
holding the graph of every operation that made it, and with it their saved activations. The
decode graph runner's logits buffer is written in place by every capture forward, so it
would hold all of them for the process's life (measured on the CPU: 8 KiB + 36 KiB per layer
per row, about 3.9 GiB for Qwen3-0.6B at 256 rows). So:
- every loader (safetensors, GGUF blocks, int8, random weights) returns a model none of
  whose parameters requires grad (tests/unit/test_quantization.py holds the GGUF case);
- the graph runner's capture runs under inference mode: here its real loop runs on the CPU
  over stand-ins for the CUDA stream and graph API, every bucket's forward run as it would
  be recorded, with parameters made to require grad again, and the logits buffer keeps no
  history;
- every forward the engine serves (prefill, eager decode through the graph buffers, the
  sampled tokens and logprobs) carries none either.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from tiny import tiny_cpu_engine

from minisgl import LLM, SamplingParams
from minisgl.distributed import TPInfo
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model

pytest.importorskip("triton")  # the capturable backend (in Triton's interpreter on a CPU)

PROMPTS = [[(j * 5 + 7) % 400 + 3 for j in range(n)] for n in (11, 6, 17)]


def _no_history(t: torch.Tensor) -> bool:
    return not t.requires_grad and t.grad_fn is None


@pytest.mark.parametrize("how", ["safetensors", "dummy", "int8"])
def test_no_parameter_requires_grad_after_loading(how, tiny_dirs) -> None:
    model_dir = tiny_dirs["qwen2"]
    model = load_model(
        ModelConfig.from_dir(model_dir), TPInfo(0, 1), model_dir, torch.device("cpu"),
        torch.float32, quantization="int8" if how == "int8" else "none",
        dummy_weights=how == "dummy",
    )  # fmt: skip
    params = list(model.parameters())
    assert params  # the norms at least
    assert [n for n, p in model.named_parameters() if p.requires_grad] == []


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


class _FakeGraph:
    """Stands for torch.cuda.CUDAGraph: the body of `torch.cuda.graph(g)` runs eagerly."""

    def __init__(self) -> None:
        self.recorded = False

    def pool(self) -> int:
        return 0

    def replay(self) -> None:
        raise AssertionError("a CPU test replays nothing")


@contextlib.contextmanager
def _fake_capture(graph: _FakeGraph, pool=None):
    graph.recorded = True
    yield


def _fake_cuda(monkeypatch) -> None:
    """The CUDA calls of DecodeGraphRunner.capture, as no-ops that a CPU can run."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", _FakeStream)
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(cuda, "graph", _fake_capture)
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)


def test_capture_records_no_history_even_over_parameters_that_require_grad(
    tiny_dirs, monkeypatch
) -> None:
    engine = tiny_cpu_engine(tiny_dirs["llama"], attention_backend="triton", max_running_requests=2)
    runner = engine.graph_runner
    assert runner is not None and runner.graphs == {} and not runner.records  # a CPU
    engine.model.requires_grad_(True)  # as a model built without the loader would be
    outputs: list[torch.Tensor] = []
    hook = engine.model.register_forward_hook(lambda m, args, out: outputs.append(out))
    _fake_cuda(monkeypatch)
    runner.records = True
    try:
        runner.capture()  # the real loop: warm-up forwards, then the one recorded
    finally:
        hook.remove()
        engine.model.requires_grad_(False)
    assert sorted(runner.graphs) == runner.buckets == [1, 2]
    assert all(g.recorded for g in runner.graphs.values())
    assert len(outputs) == 3 * len(runner.buckets)  # two warm-ups and the recorded one
    assert all(_no_history(out) for out in outputs)
    assert _no_history(runner.logits)


def test_served_forwards_and_the_graph_buffers_carry_no_history(tiny_dirs) -> None:
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64,
              attention_backend="triton", max_running_requests=2)  # fmt: skip
    engine = llm.engine
    assert engine.graph_runner is not None  # decode steps run through its buffers
    outputs: list[torch.Tensor] = []
    hook = engine.model.register_forward_hook(lambda m, args, out: outputs.append(out))
    logits: list[torch.Tensor] = []
    launch = engine.runner.run

    def run(batch):
        forward = launch(batch)
        if forward[1] is not None:
            logits.append(forward[1])
        return forward

    engine.runner.run = types.MethodType(lambda self, batch: run(batch), engine.runner)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, params)
    finally:
        hook.remove()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert engine.graph_runner.steps > 0 and outputs and logits
    assert [n for n, p in engine.model.named_parameters() if p.requires_grad] == []
    assert all(_no_history(t) for t in outputs + logits)
    assert _no_history(engine.graph_runner.logits)
