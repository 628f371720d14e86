"""The Triton backend against the torch backend on random paged inputs.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)
at small shapes; on CUDA (tests marked gpu) at Qwen3-0.6B's shapes in bf16, measured by
relative error against a float32 reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minisgl.attention.check import paged_layout  # noqa: E402
from minisgl.attention.torch_backend import TorchBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonBackend, num_splits_for  # noqa: E402
from minisgl.kvcache import KVCachePool  # noqa: E402


def _pools(H, Hkv, D, ps, num_pages, dtype, device, seed):
    torch.manual_seed(seed)
    ref = KVCachePool(1, num_pages, ps, Hkv, D, dtype, device)
    ref.k.normal_()
    ref.v.normal_()
    ours = KVCachePool(1, num_pages, ps, Hkv, D, dtype, device)
    ours.k.copy_(ref.k)
    ours.v.copy_(ref.v)
    return ref, ours


CONFIGS = [(4, 2, 32, 4), (6, 2, 64, 16), (4, 4, 16, 1)]  # (H, Hkv, D, page_size)


@pytest.mark.parametrize(("H", "Hkv", "D", "ps"), CONFIGS)
@pytest.mark.parametrize("phase", ["mixed", "decode"])
def test_triton_matches_torch_on_random_paged_inputs(H, Hkv, D, ps, phase) -> None:
    if phase == "mixed":  # prefills with and without a cached prefix, and single tokens
        reqs = [(0, 9), (5, 1), (13, 6), (3, 1), (0, 1), (2, 40)]
    else:  # every request adds one token: the split-KV decode kernel
        reqs = [(0, 1), (7, 1), (33, 1), (90, 1), (16, 1)]
    num_pages = 256 // ps + 8
    ref_pool, pool = _pools(H, Hkv, D, ps, num_pages, torch.float32, torch.device("cpu"), 0)
    info = paged_layout(reqs, ps, 0, seed=1, device=torch.device("cpu"))
    T = len(info.positions)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)

    torch_backend, triton_backend = TorchBackend(ref_pool, H, D), TritonBackend(pool, H, D)
    expected = torch_backend.attention(0, q, k, v, torch_backend.prepare(info))
    got = triton_backend.attention(0, q, k, v, triton_backend.prepare(info))

    assert torch.equal(pool.k, ref_pool.k) and torch.equal(pool.v, ref_pool.v)  # the KV write
    assert (got - expected).abs().max().item() < 1e-4


def test_split_count_fills_the_gpu_but_never_splits_short_sequences() -> None:
    assert num_splits_for(1, 8, 40960, 132) == 16  # one request: as many splits as allowed
    assert num_splits_for(256, 8, 40960, 132) == 1  # a full batch fills the GPU by itself
    assert num_splits_for(1, 8, 300, 132) == 2  # 300 tokens: at most two 256-token splits


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["mixed", "decode"])
def test_triton_bf16_at_qwen3_shapes_is_close_to_float32(phase) -> None:
    H, Hkv, D, ps = 16, 8, 128, 16
    if phase == "mixed":
        reqs = [(0, 900), (300, 1), (1000, 200), (0, 1), (2000, 64)]
    else:
        reqs = [(n, 1) for n in (0, 17, 511, 1023, 4095, 2047, 64, 3000)]
    num_pages = 8192 // ps * 2
    device = torch.device("cuda")
    ref_pool, pool = _pools(H, Hkv, D, ps, num_pages, torch.float32, device, 0)
    pool.k, pool.v = pool.k.bfloat16(), pool.v.bfloat16()
    info = paged_layout(reqs, ps, 0, seed=1, device=device)
    T = len(info.positions)
    q, k, v = (torch.randn(T, h, D, device=device) for h in (H, Hkv, Hkv))
    torch_backend, triton_backend = TorchBackend(ref_pool, H, D), TritonBackend(pool, H, D)
    expected = torch_backend.attention(0, q, k, v, torch_backend.prepare(info))
    got = triton_backend.attention(
        0, q.bfloat16(), k.bfloat16(), v.bfloat16(), triton_backend.prepare(info)
    ).float()
    rel = (got - expected).norm() / expected.norm()
    assert rel < 2e-2, f"relative error {rel:.4f}"


# ---------------------------------------------------------------- one compiled prefill kernel
def _specialization(kernel, **jit_options):
    """f(*args, **kwargs) -> the specialization Triton compiles `kernel` for (its cache key
    less the device and options), computed by Triton's own binder; `jit_options` replace
    the kernel's (e.g. do_not_specialize=[] for the default). Under TRITON_INTERPRET=1 the
    kernel is an InterpretedFunction: the JITFunction of the same source is made here."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    options = dict(getattr(kernel, "kwargs", {}))  # the interpreter keeps jit()'s options
    if isinstance(kernel, JITFunction):
        names = ("do_not_specialize", "do_not_specialize_on_alignment")
        options = {name: getattr(kernel, name) for name in names}
    jit = JITFunction(kernel.fn, **(options | jit_options))
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    return lambda *args, **kwargs: repr(binder(*args, **kwargs)[1])


def test_one_prefill_kernel_serves_the_offline_workload_and_the_self_check_warms_it(
    tiny_dirs, monkeypatch
) -> None:
    """The offline benchmark's workload (benchmarks/offline.py, shrunk to the tiny model)
    through the real scheduler and the Triton backend: prefill steps of one to four
    requests, chunked, mixed with decodes, each argument set the prefill kernel is launched
    with keyed as Triton keys its compiled kernels. One kernel serves them all, and it is
    the one the start-up self-check launches first (so no step compiles)."""
    import offline

    from minisgl import LLM, SamplingParams
    from minisgl.attention import triton_kernels as tk

    plain = dict(do_not_specialize=[], do_not_specialize_on_alignment=[])  # Triton's default
    try:
        ours, default = (
            _specialization(tk._prefill_kernel),
            _specialization(tk._prefill_kernel, **plain),
        )
    except (ImportError, AttributeError, TypeError) as exc:  # Triton's internals moved
        pytest.skip(f"this triton computes its specializations elsewhere: {exc}")
    real = tk._prefill_kernel
    calls: list[tuple[str, str, list[int]]] = []  # (ours, Triton's default, facts)

    class Recorder:  # launches the real kernel, after keying its arguments
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                ext_lens, stride_bt = args[7], args[16]  # (B,) int32; the table's row stride
                facts = [len(ext_lens), stride_bt, ext_lens.data_ptr() % 16]
                calls.append((ours(*args, **kwargs), default(*args, **kwargs), facts))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(tk, "_prefill_kernel", Recorder())
    monkeypatch.setenv("MINISGL_SELF_CHECK_ON_CPU", "1")
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=16, max_seq_len=64,
              attention_backend="triton", max_running_requests=4, max_prefill_tokens=24)  # fmt: skip
    assert llm.engine.self_check.enabled and not llm.engine.degraded
    warmed = {key for key, _, _ in calls}
    at_startup = len(calls)
    prompts, max_tokens = offline.make_workload(10, 1, 40)
    prompts = [[t % 500 + 3 for t in p] for p in prompts]  # the tiny model's vocabulary
    params = [SamplingParams(max_tokens=min(n, 3), ignore_eos=True) for n in max_tokens]
    llm.generate(prompts, params)

    served = calls[at_startup:]
    assert len(served) >= 2 * 5  # two layers, several prefill steps
    batch_sizes = {b for _, _, (b, _, _) in served}
    strides = {s for _, _, (_, s, _) in served}
    assert len(batch_sizes) > 1 and any(b % 4 for b in batch_sizes)  # unpadded: misaligned
    assert 1 in strides and len(strides) > 1  # the longest request's page count
    assert {align for _, _, (_, _, align) in served} == {0}  # every metadata array aligned
    assert len({d for _, d, _ in served}) > 1  # what Triton's defaults would have compiled
    assert {key for key, _, _ in served} == warmed and len(warmed) == 1
