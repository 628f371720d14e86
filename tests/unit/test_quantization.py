"""Quantized weights (`--quantization gguf|int8`, minisgl.models.quant / gguf_quant / loader).

- GGUF blocks become exactly the values gguf's own dequantizer gives (Q4_0, Q4_1, Q4_K,
  Q5_0, Q5_1, Q5_K, Q8_0), Q6_K within its requantization bound; other types are refused
  with their name.
- The int4 kernel's matmul (decode sizes and the dequantized prefill GEMM) against the
  float matmul of the same weights: within bf16 rounding of input and output, which is
  what the CPU kernels compute with (tolerance: 1 % of the largest output, |y| <= 30 here).
  Rows split over a helper thread (minisgl.utils.split) give the one-thread values.
- A tiny Llama written as a GGUF file in the test (Q8_0 and Q4_0 tensors) served from
  its blocks gives the float path's greedy tokens, also over two tensor-parallel ranks;
  int8 built at load gives transformers' first greedy tokens on the tiny checkpoints.
- The embedded model serves its own blocks by default and greedily continues the
  chapter's prompt as the float32 path does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import hf_references

from minisgl import LLM, SamplingParams
from minisgl.models.gguf_quant import (
    UnsupportedGGUFType,
    gguf_tensor_weight,
    iter_gguf_weights,
    read_tensor_infos,
)
from minisgl.models.loader import GGUF_LINK, resolve_quantization
from minisgl.models.quant import (
    DEQUANT_ROWS,
    PREFILL_ROWS,
    GroupQuant,
    Int4Linear,
    Int8Linear,
)
from minisgl.utils import split

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(3 + i * 11)] for i in range(4)]
NEW_TOKENS = 10


# ------------------------------------------------------------------ GGUF blocks
def _random_k_blocks(kind: str, n_blocks: int, rng) -> np.ndarray:
    """Random bytes for a k-quant (gguf-py cannot quantize these), with sane fp16 scales."""
    size = gguf.GGML_QUANT_SIZES[Q[kind]][1]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, (n_blocks, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":  # ql, qh, int8 scales, then d
        blocks[:, -2:] = d[:, :2]
    else:  # d and dmin first
        blocks[:, :4] = d
    return blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_gguf_blocks_become_exactly_the_files_values(kind):
    rng = np.random.default_rng(0)
    shape = (8, 512)  # 8 rows of 512: 16 blocks of 32 or 2 super-blocks of 256 each
    if kind.endswith("_K"):
        data = _random_k_blocks(kind, shape[0] * 2, rng).reshape(shape[0], -1)
    else:
        w = rng.standard_normal(shape).astype(np.float32)
        data = gguf.quants.quantize(w, Q[kind])
    want = gguf.quants.dequantize(data, Q[kind]).reshape(shape)
    got = gguf_tensor_weight("t", kind, data, shape)
    assert isinstance(got, GroupQuant) and got.bits == (
        4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8
    )
    # scale * code + offset against gguf's d * (q - z) + m: equal up to float32 rounding
    np.testing.assert_allclose(got.dequantize().numpy(), want, rtol=0, atol=1e-6)


def test_q6_k_is_requantized_to_8_bit_groups_within_their_step():
    rng = np.random.default_rng(1)
    shape = (4, 512)
    data = _random_k_blocks("Q6_K", shape[0] * 2, rng).reshape(shape[0], -1)
    want = gguf.quants.dequantize(data, Q.Q6_K).reshape(shape)
    got = gguf_tensor_weight("t", "Q6_K", data, shape)
    groups = want.reshape(shape[0], -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / 255  # each group's 8-bit step
    err = np.abs(got.dequantize().numpy() - want).reshape(groups.shape)
    assert (err <= step[..., None] * 0.5001 + 1e-6).all()  # half a step (ties round either way)


def test_unsupported_types_are_refused_by_name():
    data = np.zeros((2, 84), dtype=np.uint8)  # two Q2_K super-blocks
    with pytest.raises(UnsupportedGGUFType, match=r"blk\.3\.ffn_up\.weight is Q2_K.*none"):
        gguf_tensor_weight("blk.3.ffn_up.weight", "Q2_K", data, (2, 256))


# ------------------------------------------------------------------ kernels
def _group_quant(n: int, k: int, bits: int, seed: int = 0) -> GroupQuant:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * (0.02 if bits == 4 else 0.002)
    offset = -scale * (2 ** (bits - 1)) + torch.randn(n, k // 32, generator=gen) * 0.002
    return GroupQuant(codes, scale, offset, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 16, DEQUANT_ROWS + 3])
def test_int4_kernel_matches_the_float_matmul_of_the_same_weights(bits, rows):
    gq = _group_quant(200, 96, bits)  # 200 outputs: padded to 256 inside
    layer = Int4Linear(gq)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    want = x @ gq.dequantize().T
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= 0.01 * want.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_read_back_out_of_the_packed_weight(bits):
    gq = _group_quant(130, 64, bits, seed=2)
    layer = Int4Linear(gq)
    ids = torch.tensor([0, 1, 31, 32, 63, 64, 100, 129])
    # exactly the packed values: the codes, with the scales and zeros rounded to bf16
    want = gq.dequantize()[ids]
    assert torch.allclose(layer.rows(ids), want, rtol=0, atol=4e-3 * want.abs().max())
    # the prefill GEMM's bf16 weight: each value rounded once, within half a bf16 step
    whole, exact = layer.dequantize_bf16().float()[ids], layer.rows(ids)
    assert ((whole - exact).abs() <= exact.abs() * 2**-8 + 1e-7).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [2, 5, 16, DEQUANT_ROWS + 3])
def test_two_threads_give_one_threads_values(bits, rows, split_halves):
    """Rows split over the helper thread: the int4 kernel bit for bit (it computes each
    row the same whatever the rows around it), the prefill GEMM up to summation order."""
    layer = Int4Linear(_group_quant(200, 96, bits))
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(4))
    one = layer(x)
    layer.two_threads = True
    with torch.inference_mode():
        two = layer(x)
    if rows < DEQUANT_ROWS:  # two halves of the rows
        assert sorted(split_halves) == sorted([(rows // 2, 256), (rows - rows // 2, 256)])
        assert torch.equal(one, two)
    else:  # two halves of the output rows, each dequantized by its own thread
        assert sorted(split_halves) == [(rows, 72), (rows, 128)]
        torch.testing.assert_close(two, one, rtol=1e-2, atol=1e-2 * one.abs().max().item())


def test_a_gated_mlp_split_over_two_threads_gives_one_threads_values(split_halves):
    from minisgl.models.layers import GatedMLP

    mlp = GatedMLP(64, 96)
    mlp.gate_up_proj = Int4Linear(_group_quant(192, 64, 4, seed=5))
    mlp.down_proj = Int4Linear(_group_quant(64, 96, 4, seed=6))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(7))
    one = mlp(x)
    mlp.gate_up_proj.two_threads = mlp.down_proj.two_threads = True
    two = mlp(x)
    # one hand-over for the block: nothing inside splits again
    assert sorted(split_halves) == [(3, 64), (4, 64)]
    assert torch.equal(one, two)


def test_a_failure_on_the_helper_thread_is_raised_after_both_halves():
    def fn(x):
        if len(x) == 2:  # the second half of four rows
            raise RuntimeError("helper half failed")
        return x * 2

    with pytest.raises(RuntimeError, match="helper half failed"):
        split.by_rows(fn, torch.ones(4, 3))
    assert torch.equal(split.by_rows(lambda x: x * 2, torch.ones(5, 3)), torch.full((5, 3), 2.0))
    assert not split.worth_splitting(1, 1 << 30)  # a single row never splits


def test_int8_per_channel_matches_the_float_matmul():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))
    layer = Int8Linear(w)
    x = torch.randn(7, 64)
    want = x @ w.T
    assert (layer(x) - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.allclose(layer.rows(torch.tensor([5, 9])), w[[5, 9]], atol=0.02)


def test_group_quant_slices_like_a_tensor_and_refuses_a_cut_group():
    gq = _group_quant(8, 64, 4)
    assert torch.equal(gq[2:5].dequantize(), gq.dequantize()[2:5])
    assert torch.equal(gq[:, 32:64].dequantize(), gq.dequantize()[:, 32:64])
    with pytest.raises(ValueError, match="cut a group"):
        gq[:, 16:48]


# ------------------------------------------------------------------ a tiny model as a GGUF
_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf_model(src: Path, out: Path) -> Path:
    """`src` (a tiny float Llama checkpoint) as a GGUF file, matrices in Q8_0 (the
    embedding) and Q4_0 (the rest), plus a float checkpoint of the same, dequantized,
    values: the folder the converter would have written, with its `model.gguf` link."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    writer = gguf.GGUFWriter(str(out / "tiny.gguf"), "llama")
    dequantized = {}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, kind = "token_embd.weight", Q.Q8_0
        elif name == "model.norm.weight":
            gname, kind = "output_norm.weight", Q.F32
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
            kind = Q.F32 if w.ndim == 1 else Q.Q4_0
        if "q_proj" in name:
            w = _llama_cpp_permute(w, heads)
        elif "k_proj" in name:
            w = _llama_cpp_permute(w, kv_heads)
        data = w if kind == Q.F32 else gguf.quants.quantize(w, kind)
        writer.add_tensor(gname, data, raw_dtype=kind)
        back = gguf.quants.dequantize(data, kind).reshape(w.shape)
        if "q_proj" in name:
            back = _llama_cpp_permute_inverse(back, heads)
        elif "k_proj" in name:
            back = _llama_cpp_permute_inverse(back, kv_heads)
        dequantized[name] = torch.from_numpy(np.array(back, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in out.glob("*.safetensors*"):
        f.unlink()
    save_file(dequantized, str(out / "model.safetensors"))
    (out / GGUF_LINK).symlink_to(out / "tiny.gguf")
    return out


def _llama_cpp_permute_inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    from minisgl.models.gguf import unpermute_qk

    return unpermute_qk(w, n_head)


@pytest.fixture(scope="module")
def gguf_dir(tiny_dirs, tmp_path_factory) -> Path:
    return _write_gguf_model(tiny_dirs["llama"], tmp_path_factory.mktemp("tiny-gguf") / "m")


def test_the_tensor_directory_is_read_without_the_metadata(gguf_dir):
    buf = np.memmap(gguf_dir / "tiny.gguf", dtype=np.uint8, mode="r")
    infos, start = read_tensor_infos(buf)
    reader = gguf.GGUFReader(str(gguf_dir / "tiny.gguf"))
    assert [(n, t, s) for n, t, s, _ in infos] == [
        (t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    ]
    assert [start + off for *_, off in infos] == [int(t.data_offset) for t in reader.tensors]


def test_served_from_its_blocks_a_tiny_gguf_gives_the_float_paths_tokens(gguf_dir):
    weights = dict(iter_gguf_weights(gguf_dir / "tiny.gguf", 4, 2))
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], GroupQuant)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    options = dict(device="cpu", page_size=4, max_prefill_tokens=16)
    outs = {}
    for q in ("none", "gguf"):
        llm = LLM(str(gguf_dir), quantization=q, **options)
        assert llm.engine.quantization == q
        # prefill chunks beside decodes take an int4 step past its GEMM path's threshold,
        # to the rows that share the step's dequantization
        assert llm.engine.prefill_rows == (PREFILL_ROWS if q == "gguf" else 1)
        assert PREFILL_ROWS > DEQUANT_ROWS
        assert llm.scheduler.pacer.min_rows == llm.engine.prefill_rows
        outs[q] = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs["gguf"]] == [o.token_ids for o in outs["none"]]
    for a, b in zip(outs["gguf"], outs["none"]):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            # the kernels round activations to bf16: within a tenth of a nat (0.073 seen)
            assert abs(la.logprob - lb.logprob) < 0.1


def test_two_ranks_shard_the_quantized_fused_projections(gguf_dir):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    options = dict(device="cpu", page_size=4, max_prefill_tokens=16, quantization="gguf")
    one = [o.token_ids for o in LLM(str(gguf_dir), **options).generate(PROMPTS, params)]
    llm = LLM(str(gguf_dir), tp_size=2, **options)
    try:
        attn = llm.engine.model.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, Int4Linear) and attn.qkv_proj.out_features == 2 * 16 * 2
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == one
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_built_at_load_gives_transformers_greedy_tokens(arch, tiny_dirs):
    want = hf_references(tiny_dirs, [arch], PROMPTS, NEW_TOKENS)[arch]
    llm = LLM(str(tiny_dirs[arch]), device="cpu", page_size=4, quantization="int8")
    assert isinstance(llm.engine.model.lm_head, Int8Linear)
    assert llm.engine.prefill_rows == 1  # int8 has no dequantization to share
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    # per-channel int8 of random weights moves logits by a few hundredths: the first five
    # tokens are the same; later ones part where two candidates are that close (measured:
    # one or two prompts in four, from their sixth or seventh token on)
    assert [o.token_ids[:5] for o in outs] == [w[:5] for w in want]


def test_quantization_is_resolved_or_refused_with_a_reason(gguf_dir, tiny_dirs):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization(None, gguf_dir, cpu) == "gguf"
    assert resolve_quantization(None, gguf_dir, cuda) == "none"
    assert resolve_quantization(None, tiny_dirs["llama"], cpu) == "none"
    assert resolve_quantization("int8", tiny_dirs["llama"], cpu) == "int8"
    with pytest.raises(ValueError, match="needs a model converted from a GGUF"):
        resolve_quantization("gguf", tiny_dirs["llama"], cpu)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf", gguf_dir, cuda)
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("int3", gguf_dir, cpu)


def test_no_parameter_requires_grad_after_loading_gguf_blocks(gguf_dir):
    """(The float loaders: tests/unit/test_no_autograd.py.)"""
    from minisgl.distributed import TPInfo
    from minisgl.models.config import ModelConfig
    from minisgl.models.loader import load_model

    model = load_model(ModelConfig.from_dir(gguf_dir), TPInfo(0, 1), gguf_dir,
                       torch.device("cpu"), torch.float32, quantization="gguf")  # fmt: skip
    assert isinstance(model.lm_head, Int4Linear) and list(model.parameters())  # the norms
    assert [n for n, p in model.named_parameters() if p.requires_grad] == []


# ------------------------------------------------------------------ the embedded model
def test_the_embedded_model_serves_its_own_blocks_with_the_float_paths_greedy_tokens():
    """The first 16 greedy tokens of the chapter's completion prompt: their margins are
    wide enough for the bf16 rounding inside the kernels (measured: identical)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    got = {}
    for q, threads in ((None, 1), ("none", None)):
        # one torch thread, as the server's scheduler on two cores: batched rows of the
        # quantized matmuls go half to the helper thread
        old = torch.get_num_threads()
        torch.set_num_threads(threads or old)
        try:
            llm = LLM(device="cpu", quantization=q, max_running_requests=2, max_seq_len=256)
            pays = split.helper_thread_pays(torch.device("cpu"))  # on two cores or more
        finally:
            torch.set_num_threads(old)
        got[llm.engine.quantization] = [o.token_ids for o in llm.generate(prompts, params)]
        if q is None:
            weights = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
            assert len(weights) == 30 * 4 + 1  # every projection and the (tied) LM head
            assert all(w.two_threads == pays for w in weights)
            assert "Paris" in llm.tokenizer.decode(got["gguf"][0])
        del llm
    assert got["gguf"] == got["none"]


def test_a_gguf_model_path_that_does_not_exist_is_named(tmp_path):
    from minisgl.models.source import resolve_model_dir

    with pytest.raises(FileNotFoundError, match=r"missing\.gguf: no such GGUF file"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
