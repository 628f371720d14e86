"""The start-up self-check of the CUDA fast path, driven on the CPU through its seams.

`MINISGL_SELF_CHECK_ON_CPU=1` runs the check a CUDA engine runs at start-up on a CPU engine
(the Triton kernels in Triton's interpreter), and `MINISGL_INJECT_FAULTS` breaks a part of
the fast path for real: the fault stays in the component while the engine serves. Each
fault must be found, fall back to the sound path, be named in `engine.degraded` with its
numbers, and leave an engine that generates transformers-checked greedy tokens (those of
the torch backend, which test_model_correctness.py holds to transformers').
"""

from __future__ import annotations

import faults
import pytest
import torch
from faults import InjectedFault
from tiny import tiny_cpu_engine

pytest.importorskip("triton")

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.attention.check import check_attention  # noqa: E402
from minisgl.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl.engine.selfcheck import SelfCheckError  # noqa: E402
from minisgl.kvcache import KVCachePool  # noqa: E402
from minisgl.message import DetokenizeMsg, UserMsg  # noqa: E402
from minisgl.scheduler import Scheduler  # noqa: E402
from minisgl.scheduler.config import SchedulerConfig  # noqa: E402
from minisgl.server.args import parse_args  # noqa: E402

PROMPTS = [[(j * 7 + 3) % 400 + 3 for j in range(n)] for n in (9, 14)]
NEW = 6
TRITON = dict(attention_backend="triton", max_running_requests=2)


@pytest.fixture
def on_cpu(monkeypatch):
    """Run the self-check on CPU engines, with the faults the test sets."""
    monkeypatch.setenv("MINISGL_SELF_CHECK_ON_CPU", "1")
    monkeypatch.delenv("MINISGL_INJECT_FAULTS", raising=False)

    def inject(names: str) -> None:
        # into the engines of this process, and of the tensor-parallel ranks it starts
        for name, value in faults.site_env(names).items():
            monkeypatch.setenv(name, value)
        faults.install(monkeypatch)

    return inject


@pytest.fixture(scope="module")
def reference(tiny_dirs) -> list[list[int]]:
    """Greedy tokens of the torch backend with synchronous steps, no self-check."""
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


def _generate(sched: Scheduler) -> list[list[int]]:
    """Admit PROMPTS and advance the scheduler until idle: each prompt's tokens."""
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for uid, prompt in enumerate(PROMPTS):
        assert sched.process_msg(UserMsg.make(uid, prompt, params)) == []
    tokens: dict[int, list[int]] = {uid: [] for uid in range(len(PROMPTS))}
    for _ in range(100):
        if not sched.has_work:
            return [tokens[uid] for uid in range(len(PROMPTS))]
        for r in sched.advance():
            if isinstance(r, DetokenizeMsg):
                tokens[r.uid].append(r.next_token)
    raise AssertionError("the scheduler did not become idle")


# ---------------------------------------------------------------- the attention check
class _WrongValues(TorchBackend):
    def attention(self, layer_id, q, k, v, meta):
        return super().attention(layer_id, q, k, v, meta) * 1.01  # 1 % off: well past float32


class _WrongSlot(TorchBackend):
    def attention(self, layer_id, q, k, v, meta):
        meta.out_slots = meta.out_slots + 1  # every K/V one slot too far
        return super().attention(layer_id, q, k, v, meta)


def _pool(dtype=torch.float32) -> KVCachePool:
    return KVCachePool(1, 64, 4, 2, 16, dtype, torch.device("cpu"))


def test_the_attention_check_passes_a_sound_backend_in_each_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        results = check_attention(TorchBackend(_pool(dtype), 4, 16), "torch", max_len=40)
        assert [r.name for r in results] == ["torch decode", "torch prefill", "torch store"]
        assert all(r.passed for r in results), [r.describe() for r in results]
        store = results[-1]
        assert store.max_error == 0.0 and store.tolerance == 0.0  # a copy is exact


def test_wrong_values_fail_attention_but_not_the_store() -> None:
    decode, prefill, store = check_attention(_WrongValues(_pool(), 4, 16), "torch", max_len=40)
    assert not decode.passed and not prefill.passed and store.passed
    assert decode.max_error > decode.tolerance
    assert "max error" in decode.describe() and "> tolerance" in decode.describe()


def test_a_store_into_the_wrong_slot_fails_the_store() -> None:
    *_, store = check_attention(_WrongSlot(_pool(), 4, 16), "torch", max_len=40)
    assert not store.passed and store.max_error > 0


def test_an_exception_is_a_failed_check_that_names_it() -> None:
    class Refuses(TorchBackend):
        def prepare(self, info):
            raise RuntimeError("PassManager::run failed\nmore lines")

    results = check_attention(Refuses(_pool(), 4, 16), "triton")
    assert not any(r.passed for r in results)
    assert "RuntimeError: PassManager::run failed" in results[0].detail
    assert "more lines" not in results[0].detail


# ---------------------------------------------------------------- the engine's start-up
def test_a_sound_fast_path_passes_and_keeps_triton_graphs_and_overlap(tiny_dirs, on_cpu) -> None:
    engine = tiny_cpu_engine(tiny_dirs["llama"], **TRITON)
    names = [r.name for r in engine.self_check.results]
    assert names == ["triton decode", "triton prefill", "triton store",
                     "cuda_graph bs=1", "cuda_graph bs=2"]  # fmt: skip
    assert all(r.passed for r in engine.self_check.results)
    sched = Scheduler(engine, SchedulerConfig(overlap_schedule=True))
    assert sched.overlap and engine.self_check.results[-1].name == "overlap"
    assert engine.degraded == {}
    assert type(engine.attn_backend).__name__ == "TritonBackend"
    assert engine.graph_runner is not None


@pytest.mark.parametrize(
    ("fault", "part", "why"),
    [
        ("triton-values", "triton", "max error"),
        ("triton-compile", "triton", "CompilationError"),
        ("graph-capture", "cuda_graph", "operation not permitted when stream is capturing"),
    ],
)
def test_a_broken_part_falls_back_and_serves_correct_tokens(
    tiny_dirs, on_cpu, reference, caplog, fault, part, why
) -> None:
    on_cpu(fault)
    engine = tiny_cpu_engine(tiny_dirs["llama"], **TRITON)
    assert list(engine.degraded) == [part]
    assert why in engine.degraded[part]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and why in errors[0] and "falling back" in errors[0]
    assert engine.graph_runner is None  # torch is not captured; a failed capture is dropped
    backend = type(engine.attn_backend).__name__
    assert backend == ("TorchBackend" if part == "triton" else "TritonBackend")
    assert _generate(Scheduler(engine, SchedulerConfig(overlap_schedule=False))) == reference


def test_stale_pending_tokens_fall_back_to_synchronous_steps(tiny_dirs, on_cpu, reference) -> None:
    on_cpu("overlap")  # the next step never sees the tokens a step sampled
    engine = tiny_cpu_engine(tiny_dirs["llama"], attention_backend="torch")
    sched = Scheduler(engine, SchedulerConfig(overlap_schedule=True))
    assert not sched.overlap
    assert "tokens differing" in engine.degraded["overlap"]
    assert "first difference: sequence" in engine.degraded["overlap"]
    assert _generate(sched) == reference


def test_one_rank_s_failure_is_every_rank_s_fallback(tiny_dirs, on_cpu, reference) -> None:
    on_cpu("triton-values@1")  # rank 1's Triton backend alone is wrong
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64, tp_size=2,
              **TRITON)  # fmt: skip
    try:
        # rank 0's own check passed, yet it falls back with rank 1: both serve with torch
        assert [r.passed for r in llm.engine.self_check.results if r.part == "triton"] == [True] * 3
        assert llm.engine.degraded["triton"].startswith("rank 1: triton decode: max error")
        assert type(llm.engine.attn_backend).__name__ == "TorchBackend"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference  # rank 1's wrong Triton is not used
    finally:
        llm.close()


def test_strict_makes_a_failure_fatal_with_the_reason(tiny_dirs, on_cpu) -> None:
    on_cpu("triton-compile")
    with pytest.raises(SelfCheckError, match="--strict-self-check.*triton decode.*Compilation"):
        LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64,
            self_check="strict", **TRITON)  # fmt: skip


def test_strict_overlap_failure_stops_the_scheduler_s_start(tiny_dirs, on_cpu) -> None:
    on_cpu("overlap")
    engine = tiny_cpu_engine(tiny_dirs["llama"], attention_backend="torch", self_check="strict")
    with pytest.raises(SelfCheckError, match="overlap: tokens differing"):
        Scheduler(engine, SchedulerConfig(overlap_schedule=True))


def test_a_broken_torch_backend_leaves_nothing_to_fall_back_to(
    tiny_dirs, on_cpu, monkeypatch
) -> None:
    monkeypatch.setattr(TorchBackend, "attention", _WrongValues.attention)
    with pytest.raises(SelfCheckError, match="nothing to fall back to.*torch decode"):
        tiny_cpu_engine(tiny_dirs["llama"], attention_backend="torch")


def test_a_capture_that_leaves_a_sticky_cuda_error_fails_start_up_saying_so(
    tiny_dirs, on_cpu, monkeypatch
) -> None:
    """After an illegal access every CUDA call fails: eager decode is no fallback."""
    from minisgl.engine import selfcheck

    on_cpu("graph-capture")
    sticky = "AcceleratorError: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(selfcheck, "cuda_context_error", lambda device: sticky)
    with pytest.raises(SelfCheckError, match="left the CUDA context unusable: AcceleratorError"):
        tiny_cpu_engine(tiny_dirs["llama"], **TRITON)


def test_a_context_that_still_computes_has_no_error(monkeypatch) -> None:
    from minisgl.engine.selfcheck import cuda_context_error

    assert cuda_context_error(torch.device("cpu")) is None

    def raise_sticky(*a):
        raise RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors ...")

    monkeypatch.setattr(torch.cuda, "synchronize", raise_sticky)
    assert cuda_context_error(torch.device("cuda")) == (
        "RuntimeError: CUDA error: unspecified launch failure"
    )


def test_skip_checks_nothing_and_catches_nothing(tiny_dirs, on_cpu) -> None:
    engine = tiny_cpu_engine(tiny_dirs["llama"], self_check="skip")
    assert engine.self_check.results == [] and engine.check_overlap()
    on_cpu("graph-capture")
    with pytest.raises(InjectedFault, match="graph-capture"):
        tiny_cpu_engine(tiny_dirs["llama"], self_check="skip", **TRITON)


def test_without_the_seam_a_cpu_engine_checks_nothing(tiny_dirs, monkeypatch) -> None:
    monkeypatch.delenv("MINISGL_SELF_CHECK_ON_CPU", raising=False)
    engine = tiny_cpu_engine(tiny_dirs["llama"])
    assert engine.self_check.results == [] and engine.degraded == {}


def test_an_unknown_fault_is_refused(tiny_dirs, on_cpu) -> None:
    on_cpu("triton-values,cosmic-ray")
    with pytest.raises(ValueError, match="unknown fault 'cosmic-ray'"):
        tiny_cpu_engine(tiny_dirs["llama"])


def test_the_flags_set_the_mode() -> None:
    assert parse_args([]).engine_config.self_check == "auto"
    assert parse_args(["--strict-self-check"]).engine_config.self_check == "strict"
    assert parse_args(["--skip-self-check"]).engine_config.self_check == "skip"
    with pytest.raises(SystemExit):
        parse_args(["--strict-self-check", "--skip-self-check"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_on_cuda_the_start_up_check_passes_at_qwen3_s_attention_shape(tmp_path, dtype) -> None:
    """The real thing: Triton compiled for this GPU, every decode bucket captured and
    replayed, overlapped steps with real asynchrony. The issue asks for well under a few
    seconds; the bound here is generous (kernel compilation is inside it)."""
    from minisgl.doctor.checks import ENGINE_MODEL, write_config
    from minisgl.engine.build import build_engine
    from minisgl.engine.config import EngineConfig

    model = write_config(tmp_path, {"num_hidden_layers": 2, **ENGINE_MODEL["cuda"]})
    engine = build_engine(EngineConfig(model=str(model), device="cuda", dtype=dtype,
                                 dummy_weights=True, num_pages=2048))  # fmt: skip
    assert engine.check_overlap()
    failed = [r.describe() for r in engine.self_check.results if not r.passed]
    assert failed == [] and engine.degraded == {}
    assert engine.graph_runner is not None
    assert sorted(engine.graph_runner.graphs) == engine.graph_runner.buckets
    graph = [r for r in engine.self_check.results if r.part == "cuda_graph"]
    assert len(graph) == len(engine.graph_runner.buckets)
    assert engine.self_check.seconds < 30, engine.self_check.summary()
