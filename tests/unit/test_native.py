"""The native decode step (minisgl.models.native, native_decode.c and its headers).

- Each matrix-vector kernel on torch's packed int4 weights (4-bit and 8-bit codes, a bias,
  output rows that do not fill the last block) against the float32 matmul of the same
  packed values: each output within what rounding the input to 15-bit integers per group
  of 32 can move it by (half a step per input, times |w|). The AVX-512 kernels ("quads"
  with VBMI and VNNI, "pairs" without) read torch's own 64-row packing; the AVX2 and plain
  C ones codes packed by the test, whose packing of 64-row blocks is torch's, byte for byte.
  Each library is built with the flags that select its kernel and says which it has.
- A row's result is the same alone or among others (bit for bit).
- A tiny Llama GGUF served with native decode steps gives the float path's greedy tokens,
  one request at a time and in a batch that shrinks to one (batches of decodes run
  natively too), with logprobs no further from the float path's than the torch path's
  are; native steps really ran, of one token and of the batch's four; the engine ends idle. So does a long context (the attention's
  tiles and its runs of positions merged), alike bit for bit on one thread and two.
- Qwen2's q/k/v bias and Qwen3's per-head q/k norms, on tiny models whose projections are
  swapped for int4 ones: the same tokens as the torch path on those very weights.
- Where the step cannot run natively (no C compiler, float weights), the engine says why
  and serves on torch; where the start-up check finds the native kernel disagreeing with
  torch's (faked here by skewing torch's), it falls back and reports itself degraded.
- A compiler that refuses -fopenmp (as Apple's clang does; a wrapper here) gets the same
  source built on one thread, with one line saying how to get every core.
- The start-up race (engine/race.py) keeps the faster of the two paths: timings injected,
  each way; the steps it races compute the same decode step and write only scratch.
"""

from __future__ import annotations

import platform
import shutil

import common  # benchmarks/common.py
import pytest
import torch
from test_quantization import PROMPTS, _group_quant, gguf_dir  # noqa: F401 (a fixture)

from minisgl import LLM, SamplingParams
from minisgl.models import native
from minisgl.models.quant import GroupQuant, Int4Linear

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native step is not built here"
)


XQ_MAX = 16383  # native_gemv.h: x rounded per group to integers up to this


def _rounding_bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per output row, what rounding x to 15-bit integers per group of 32 can move it by:
    each input by at most half its group's step (the group's largest |x| / XQ_MAX), times
    |w|; plus float32 summation's share (1e-5 of the row's magnitude)."""
    top = x.abs().view(-1, 32).amax(1).repeat_interleave(32)  # (K,) per input, its group's
    return (w.abs() * (top / XQ_MAX / 2)).sum(1) + 1e-5 * (w.abs() * x.abs()).sum(1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(200, 96), (64, 32), (130, 256)])
def test_the_kernel_matches_the_float_matmul_of_the_same_weights(bits, n, k):
    gq = _group_quant(n, k, bits, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    layer = Int4Linear(gq, bias)
    w = layer.rows(torch.arange(n))  # the packed values (scales and zeros in bf16), float32
    x = torch.randn(k, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        want = w @ x + bias
        got = native.matmul(layer, x)
        assert got.shape == want.shape
        assert ((got - want).abs() <= _rounding_bound(w, x)).all()
        # then a group of zeros (its step is 0) and one with an outlier among small values
        x[: k - 32] = 0
        x[-1] = 100.0


def _pack(codes: torch.Tensor, block: int) -> torch.Tensor:
    """(N, K) 4-bit codes, N a multiple of `block` -> the layout the kernels read: per block
    of rows and input k, block / 2 bytes, row j's code low and row j + block / 2's high."""
    N, K = codes.shape
    rows = codes.view(N // block, 2, block // 2, K)  # (blocks, low/high, j, K)
    return (rows[:, 0] | rows[:, 1] << 4).transpose(1, 2).contiguous().view(N, K // 2)


class _Packed:  # what weight_struct reads of a packed linear
    def __init__(self, layer: Int4Linear, packed: torch.Tensor) -> None:
        self.packed, self.scale_zeros, self.bias = packed, layer.scale_zeros, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features


def _cpu_has(*flags: str) -> bool:
    return all(f" {flag}" in native._cpu_key() for flag in flags)


KERNELS = {  # kernel: (flags beside the library's own, block of rows it reads, CPU flags)
    "quads": ([], 64, ("avx512vbmi", "avx512_vnni")),
    "pairs": (["-mno-avx512vbmi"], 64, ("avx512bw",)),
    "avx2": (["-mno-avx512f"], 32, ("avx2", "fma")),
    "plain64": (["-mno-avx512f", "-mno-avx2"], 64, ()),
    "plain32": (["-mno-avx512f", "-mno-avx2"], 32, ()),
}


@pytest.fixture(scope="module")
def kernel_library():
    """The library built for one kernel (x86-64; elsewhere every build is the plain one)."""

    def build(kernel: str):
        flags, _, needs = KERNELS[kernel]
        if platform.machine() != "x86_64":
            if kernel.startswith("plain"):
                return native._load(native._compile())
            pytest.skip(f"the {kernel} kernel is x86-64's")
        if not _cpu_has(*needs):
            pytest.skip(f"this CPU lacks {', '.join(needs)} for the {kernel} kernel")
        lib = native._load(native._compile([*native.FLAGS, *flags]))
        assert native.kernel_name(lib) == kernel.removesuffix("64").removesuffix("32")
        return lib

    return build


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_every_kernel_reads_the_layout_it_is_built_for(bits, kernel, kernel_library):
    lib = kernel_library(kernel)
    block = KERNELS[kernel][1]
    gq = _group_quant(200, 96, bits, seed=7)
    layer = Int4Linear(gq, torch.randn(200, generator=torch.Generator().manual_seed(4)))
    codes = gq.codes if bits == 4 else torch.cat([gq.codes >> 4, gq.codes & 15], dim=1)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, layer.packed.shape[0] - 200))
    if native._LAYOUT._find() == (64, False):  # our reading of torch's own packing
        assert torch.equal(_pack(codes, 64), layer.packed)
    w = layer.rows(torch.arange(200))
    x = torch.randn(96, generator=torch.Generator().manual_seed(5))
    x[40] = 30.0  # an outlier: its group's other inputs get coarse steps
    got = native.matmul(_Packed(layer, _pack(codes, block)), x, lib, block)
    assert ((got - (w @ x + layer.bias)).abs() <= _rounding_bound(w, x)).all()


def _count_native_steps(llm, monkeypatch) -> list[int]:
    """[steps run natively, then each step's tokens in turn]"""
    calls = [0]
    forward = llm.engine.runner.native.forward

    def counted(input_ids, info):
        calls[0] += 1
        calls.append(input_ids.shape[0])
        return forward(input_ids, info)

    monkeypatch.setattr(llm.engine.runner.native, "forward", counted)
    return calls


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_is_the_same_alone_or_among_others(bits):
    """The kernel sums each output in an order the shapes fix: rows taken in pairs (the
    quads kernel) or one by one give the same bits."""
    gq = _group_quant(130, 96, bits, seed=11)
    layer = Int4Linear(gq, torch.randn(130, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    together = native.matmul(layer, x)
    assert together.shape == (5, 130)
    for i in range(5):
        assert torch.equal(together[i], native.matmul(layer, x[i]))
    assert torch.equal(together[1:4], native.matmul(layer, x[1:4]))


def _assert_idle(llm) -> None:
    s = llm.scheduler.state()
    assert s.pending == s.running == s.table_slots_used == s.kv_pages_used == 0


def test_a_tiny_gguf_decodes_natively_with_the_torch_paths_tokens(gguf_dir, monkeypatch):  # noqa: F811
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    outs = {}
    for path in ("native", "torch", "float"):
        q = "none" if path == "float" else "gguf"
        llm = LLM(str(gguf_dir), device="cpu", page_size=4, quantization=q,
                  native_decode=path == "native")  # fmt: skip
        assert (llm.engine.runner.native is not None) == (path == "native")
        record = common.engine_record(llm.engine)  # what a benchmark's result file says ran
        assert record["native_decode"] == (
            llm.engine.runner.native.kernel if path == "native" else None
        )
        if path == "native":
            calls = _count_native_steps(llm, monkeypatch)
        alone = [llm.generate([p], params)[0] for p in PROMPTS]  # batch-1 decodes only
        together = llm.generate(PROMPTS, params)  # batched, then one left
        outs[path] = alone + list(together)
        if path == "native":  # every decode of the requests alone, and of the batch
            assert calls[1:].count(1) >= len(PROMPTS) * 11 and len(PROMPTS) in calls[1:]
        _assert_idle(llm)
        del llm
    gap = {}
    for path in ("native", "torch"):
        gap[path] = 0.0
        for a, b in zip(outs[path], outs["float"]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                gap[path] = max(gap[path], abs(la.logprob - lb.logprob))
    # both start from the same bf16-rounded prefill and scales (0.073 nats from the float
    # path, seen); the native steps add nothing measurable to that
    assert gap["native"] < 0.1 and gap["native"] <= gap["torch"] + 0.005


def test_a_long_context_decodes_natively_as_on_torch_and_alike_on_any_thread_count(
    gguf_dir,  # noqa: F811
    monkeypatch,
):
    """170 positions: three tiles of keys, four runs merged (native_attention.h)."""
    prompt = [(j * 29 + 7) % 500 + 3 for j in range(150)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)
    outs, old = {}, torch.get_num_threads()
    try:
        for path, threads in (("native", 1), ("native", 2), ("torch", 1), ("float", 1)):
            # the prompt in one prefill step, as every path computes it (unpaced)
            llm = LLM(str(gguf_dir), device="cpu", page_size=4, native_decode=path == "native",
                      quantization="none" if path == "float" else "gguf",
                      prefill_step_seconds=0)  # fmt: skip
            llm.engine.runner.threads = None  # the count set here stands
            torch.set_num_threads(threads)
            if path == "native":
                calls = _count_native_steps(llm, monkeypatch)
            out = llm.generate([prompt], params)[0].outputs[0]
            if path == "native":
                assert calls[0] == 19  # every decode step after the prefill
            outs[path, threads] = (out.token_ids, [(p.logprob, p.top) for p in out.logprobs])
            _assert_idle(llm)
            del llm
    finally:
        torch.set_num_threads(old)
    assert outs["native", 1] == outs["native", 2]  # bit for bit
    native, torch_path, float_path = outs["native", 1], outs["torch", 1], outs["float", 1]
    agree, gap = _same_context_gap(native, float_path)
    assert agree >= 10  # the random tiny model has near ties: a late one may go either way
    assert gap <= _same_context_gap(torch_path, float_path)[1] + 0.005


def _same_context_gap(a, b) -> tuple[int, float]:
    """(tokens `a` and `b` agree on before they part, the largest difference of their best
    logprob at each position up to and with the first that differs: the same context)."""
    tokens_a, tokens_b = a[0], b[0]
    agree = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), len(tokens_a))
    best = [[max(lp for _, lp in top) for _, top in out[1]] for out in (a, b)]
    return agree, max(abs(x - y) for x, y in zip(best[0][: agree + 1], best[1][: agree + 1]))


def _int4_projections(model) -> None:
    """Every projection and the LM head of `model` swapped for an int4 copy of itself."""
    for layer in model.model.layers:
        for parent, name in (
            (layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"),
        ):  # fmt: skip
            lin = getattr(parent, name)
            gq = GroupQuant.from_float(lin.weight.detach(), bits=4)
            setattr(parent, name, Int4Linear(gq, lin.bias))
    model.lm_head = Int4Linear(GroupQuant.from_float(model.lm_head.weight.detach(), bits=8))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v bias; per-head q/k norms
def test_bias_and_qk_norm_decode_natively_as_on_torch(arch, tiny_dirs):
    llm = LLM(str(tiny_dirs[arch]), device="cpu", page_size=4, quantization="none")
    engine = llm.engine
    assert engine.runner.native is None  # float weights: the torch path
    _int4_projections(engine.model)
    decoder, why = native.NativeDecoder.build(engine.model, engine.pool)
    assert why is None
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = {}
    for on in (True, False):
        engine.runner.native = decoder if on else None
        alone = [llm.generate([p], params)[0] for p in PROMPTS]
        got[on] = [o.outputs[0].token_ids for o in alone + llm.generate(PROMPTS, params)]
    assert got[True] == got[False]


def test_without_a_compiler_the_engine_serves_on_torch_and_says_why(
    gguf_dir,  # noqa: F811
    monkeypatch,
    caplog,
):
    monkeypatch.setattr(native, "_library", None)  # forget the compiled library
    monkeypatch.setenv("CC", "no-such-compiler")
    caplog.set_level("INFO")
    llm = LLM(str(gguf_dir), device="cpu", page_size=4, quantization="gguf")
    assert llm.engine.runner.native is None
    assert "no C compiler ('no-such-compiler' is not on PATH)" in caplog.text
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_kernel_that_disagrees_with_torchs_is_a_fallback_the_engine_reports(
    gguf_dir,  # noqa: F811
    monkeypatch,
):
    forward = Int4Linear.forward
    monkeypatch.setattr(Int4Linear, "forward", lambda self, x: forward(self, x) * 1.5)
    llm = LLM(str(gguf_dir), device="cpu", page_size=4, quantization="gguf")
    assert llm.engine.runner.native is None
    assert llm.engine.degraded["native decode"].startswith(
        "the native kernel disagrees with torch's on in=64, out="
    )
    monkeypatch.undo()
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_float_weights_are_named_as_the_reason(tiny_dirs):
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import CausalLM

    class Pool:  # what build() reads of a KV pool
        k = v = torch.empty(2, 8, 1, 4)

    model = CausalLM(ModelConfig.from_dir(tiny_dirs["llama"]))
    decoder, why = native.NativeDecoder.build(model, Pool())
    assert decoder is None
    assert why == "Linear weights (the native path reads int4-packed ones)"


def test_a_compiler_without_openmp_builds_the_step_on_one_thread_and_says_how(
    tmp_path, monkeypatch, caplog
):
    """As Apple's clang does: -fopenmp refused. The same source is built without it (its
    pragmas ignored), computes what the OpenMP build does, and one line says how to get
    every core."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
        "{ echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1; }; done\n"
        'exec cc "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setattr(native, "_library", None)  # forget the compiled library
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caplog.set_level("INFO")
    lib = native.library()
    assert not isinstance(lib, str), lib
    lines = [r.getMessage() for r in caplog.records if "OpenMP" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("native decode step built without OpenMP, on one thread: ")
    assert (
        "brew install llvm libomp" in lines[0]
        if platform.system() == "Darwin"
        else f"{cc} cannot build with -fopenmp" in lines[0]
    )
    gq = _group_quant(130, 256, 4, seed=2)
    layer = Int4Linear(gq)
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    want = layer.rows(torch.arange(130)) @ x
    assert ((native.matmul(layer, x, lib) - want).abs() <= _rounding_bound(layer.rows(
        torch.arange(130)), x)).all()  # fmt: skip


def test_a_compiler_that_builds_nothing_is_the_first_builds_reason(tmp_path, monkeypatch):
    cc = tmp_path / "broken-cc"
    cc.write_text('#!/bin/sh\necho "broken-cc: internal error" >&2\nexit 1\n')
    cc.chmod(0o755)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert native.library() == f"native decode unavailable: {cc} failed: broken-cc: internal error"


# ---------------------------------------------------------------- native or torch: the race
def test_the_race_takes_turns_and_keeps_each_paths_best_time():
    from minisgl.engine import race

    order = []
    paths = {"native": lambda: order.append("n"), "torch": lambda: order.append("t")}
    # start and end of each measured step: native 5 s then 2 s, torch 1 s then 9 s
    clock = iter([0.0, 5.0, 5.0, 6.0, 10.0, 12.0, 20.0, 29.0]).__next__
    best = race.race(paths, rounds=2, clock=clock)
    assert order == ["n", "t", "n", "t", "n", "t"]  # once unmeasured, then taking turns
    assert best == {"native": 2.0, "torch": 1.0}
    assert race.pick(best) == (
        "torch",
        "torch is faster here (native 2000.00 ms, torch 1000.00 ms)",
    )
    assert race.pick({"native": 0.0031, "torch": 0.0102})[0] == "native"


@pytest.mark.parametrize(
    "times", [{"native": 0.012, "torch": 0.004}, {"native": 0.003, "torch": 0.01}]
)
def test_the_engine_keeps_the_faster_decode_path(times, gguf_dir, monkeypatch, caplog):  # noqa: F811
    """Timings injected into the engine's start-up race: torch faster -> decode steps on
    torch (not a fallback: nothing is degraded); native faster -> native steps."""
    from minisgl.engine import race

    raced = []
    monkeypatch.setattr(race, "race", lambda paths, **kw: raced.append(sorted(paths)) or times)
    caplog.set_level("INFO")
    llm = LLM(str(gguf_dir), device="cpu", page_size=4, quantization="gguf")
    assert raced == [["native", "torch"]]
    native_won = times["native"] < times["torch"]
    assert (llm.engine.runner.native is not None) == native_won and llm.engine.degraded == {}
    figures = f"(native {times['native'] * 1e3:.2f} ms, torch {times['torch'] * 1e3:.2f} ms)"
    lines = [r.getMessage() for r in caplog.records if "is faster here" in r.getMessage()]
    assert len(lines) == 1 and figures in lines[0]
    assert lines[0].startswith(
        "decode steps run natively" if native_won else "decode steps run on torch: torch"
    )
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_raced_steps_compute_the_same_decode_step(gguf_dir):  # noqa: F811
    """What is raced is one decode step both ways: the same logits (within the native
    check's 2 %), and neither touches a page a request could hold."""
    from minisgl.engine.race import decode_steps

    llm = LLM(str(gguf_dir), device="cpu", page_size=4, quantization="gguf")
    engine, decoder = llm.engine, llm.engine.runner.native
    assert decoder is not None
    scratch = engine.pool.scratch_page
    engine.pool.k[:, engine.pool.scratch_slot :].zero_()  # (the start-up race wrote there)
    before = engine.pool.k.clone()
    steps = decode_steps(engine, decoder, 1)
    got, want = steps["native"](), steps["torch"]()
    assert got.shape == want.shape == (1, engine.model_config.vocab_size)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    bits = engine.pool.k.view(torch.int32) != before.view(torch.int32)  # (L, slots, Hkv, D)
    pages = bits.view(bits.shape[0], -1, engine.page_size, *bits.shape[2:]).flatten(2).any(-1)
    assert pages.any(0).nonzero().flatten().tolist() == [scratch]  # written: the scratch page
