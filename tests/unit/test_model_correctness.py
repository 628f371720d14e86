"""Our greedy tokens equal transformers' greedy tokens on tiny random checkpoints (float32).

Three ways to run the same prompts, all of which must give transformers' tokens:
one request at a time, eight mixed-length requests batched together (continuous batching
mixes their prefills and decodes), and with chunked prefill forced on by a small budget;
the last two also with overlap scheduling, where each step is scheduled before the tokens
of the one before it are read (decode inputs come from the device) and under preemption.
"""

from __future__ import annotations

import pytest
import torch
from tiny import hf_references

from minisgl import LLM, SamplingParams
from minisgl.models.config import ModelConfig

ARCHS = ["llama", "qwen2", "qwen3"]
NEW_TOKENS = 12
# 8 prompts of mixed lengths, 3..80 tokens, ids away from the special tokens
PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(3 + i * 11)] for i in range(8)]


@pytest.fixture(scope="module")
def references(tiny_dirs) -> dict[str, list[list[int]]]:
    return hf_references(tiny_dirs, ARCHS, PROMPTS, NEW_TOKENS)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def _batched_matches(arch, tiny_dirs, references, **options) -> LLM:
    """All of PROMPTS at once through an engine built with `options` (CPU, pages of 4
    unless said otherwise): every request gets transformers' greedy tokens."""
    llm = LLM(str(tiny_dirs[arch]), **{"device": "cpu", "page_size": 4, **options})
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.token_ids for o in outs] == references[arch]
    return llm


def test_config_reads_what_sets_each_family_apart(tiny_dirs) -> None:
    llama = ModelConfig.from_dir(tiny_dirs["llama"])
    qwen2 = ModelConfig.from_dir(tiny_dirs["qwen2"])
    qwen3 = ModelConfig.from_dir(tiny_dirs["qwen3"])
    assert llama.rope.rope_type == "llama3" and llama.tie_word_embeddings
    assert qwen2.attention_bias and not qwen2.tie_word_embeddings
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size != qwen3.hidden_size
    assert len(list(tiny_dirs["qwen2"].glob("*.safetensors"))) > 1  # sharded


@pytest.mark.parametrize("arch", ARCHS)
def test_one_request_at_a_time_matches_transformers(arch, tiny_dirs, references) -> None:
    llm = LLM(str(tiny_dirs[arch]), device="cpu", page_size=4)
    for prompt, expected in zip(PROMPTS, references[arch]):
        (out,) = llm.generate([prompt], _greedy())
        assert out.token_ids == expected
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_eight_mixed_length_requests_batched_match_transformers(
    arch, tiny_dirs, references
) -> None:
    _batched_matches(arch, tiny_dirs, references)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(arch, overlap, tiny_dirs, references) -> None:
    # a budget of 7 tokens per step splits every prompt longer than 7 into chunks, and
    # chunks of one prompt share steps with other requests' decodes
    llm = _batched_matches(
        arch, tiny_dirs, references, max_prefill_tokens=7, overlap_schedule=overlap
    )
    assert llm.scheduler.state().kv_pages_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_token_prefill_chunks_match_transformers(arch, overlap, tiny_dirs, references):
    # a step of one-token chunks looks like a decode step, yet most of its rows do not
    # sample (the prompt goes on): the rows that do must be the ones sampled from (the
    # pacer gives chunks this small on a slow CPU, and so does a budget's last token)
    llm = _batched_matches(
        arch, tiny_dirs, references, max_prefill_tokens=1, num_pages=40, overlap_schedule=overlap
    )
    assert llm.scheduler.state().kv_pages_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_a_small_kv_pool_still_matches(
    arch, overlap, tiny_dirs, references
) -> None:
    # 40 pages of 4 tokens cannot hold all 8 sequences at once: the newest are preempted
    # and recomputed, and every request must still produce transformers' tokens
    llm = _batched_matches(arch, tiny_dirs, references, num_pages=40, overlap_schedule=overlap)
    assert llm.scheduler.policy.num_preemptions > 0
    state = llm.scheduler.state()
    assert state.kv_pages_used == 0 and state.table_slots_used == 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_cuda_logits_close_to_transformers(arch, tiny_dirs) -> None:
    """On CUDA in bf16, our last-position logits stay close to transformers' (float32)."""
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dirs[arch], dtype=torch.float32
    ).eval()
    llm = LLM(str(tiny_dirs[arch]), device="cuda", dtype="bfloat16", page_size=4)
    engine = llm.engine
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = ref_model(torch.tensor([prompt])).logits[0, -1]
        logits = _engine_prefill_logits(engine, prompt).cpu()
        err = (logits - expected).abs().max() / expected.abs().max()
        assert err < 0.05, f"relative logit error {err:.3f}"
    outs = llm.generate(PROMPTS, _greedy())
    for out in outs:
        assert len(out.token_ids) == NEW_TOKENS


def _engine_prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of one prefill through our engine (slot 0, fresh pages)."""
    from minisgl.core import Batch, Req
    from minisgl.scheduler.cache import CacheManager

    cache = CacheManager(engine.num_pages, engine.page_size)
    req = Req(0, list(prompt), len(prompt), len(prompt) + 1, SamplingParams(), seed=0)
    req.table_idx = 0
    cache.grow(req, len(prompt))
    engine.write_pages(cache.take_edits())
    req.extend_len = len(prompt)
    return engine.logits(Batch([req]))[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_backend_matches_transformers(arch, tiny_dirs, references) -> None:
    """The Triton kernels (in Triton's interpreter on a CPU, compiled on CUDA) inside the
    whole engine: mixed prefill/decode steps, chunked prefill and the decode kernel."""
    pytest.importorskip("triton")
    llm = _batched_matches(
        arch, tiny_dirs, references, max_prefill_tokens=16, attention_backend="triton"
    )
    # decode steps ran through the graph runner's static, padded buffers
    assert llm.engine.graph_runner is not None and llm.engine.graph_runner.steps > 0
