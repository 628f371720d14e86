"""Batched sampling: greedy, temperature, top-k, top-p, and seeds that do not depend on
what else shares the batch."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.engine.sample import Sampler, uniform_noise

PROMPTS = [[(i * 13 + j * 5) % 400 + 3 for j in range(4 + 3 * i)] for i in range(6)]


def _req(params: SamplingParams, seed: int = 0, step: int = 0) -> Req:
    return Req(0, [3] * (1 + step), 1, 100, params, seed=seed)


def test_noise_is_a_pure_function_of_seed_step_and_token() -> None:
    seeds = torch.tensor([1, 2, 1, -5, 2**62])
    steps = torch.tensor([0, 0, 1, 0, 3])
    a = uniform_noise(seeds, steps, 1000)
    b = uniform_noise(seeds.flip(0), steps.flip(0), 1000).flip(0)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert 0 < a.min() and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.01  # 5000 draws


def test_sampling_follows_the_softmax_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    sampler = Sampler(4, torch.device("cpu"))
    reqs = [_req(SamplingParams(temperature=1.0), seed=s) for s in range(4000)]
    tokens = sampler.sample(logits, sampler.prepare(reqs))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    # 4000 draws: the standard error of each frequency is below 0.008
    assert torch.allclose(freq, probs, atol=0.04), freq


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).expand(500, 5).clone()
    sampler = Sampler(5, torch.device("cpu"))
    top_k = [_req(SamplingParams(temperature=5.0, top_k=2), seed=s) for s in range(500)]
    assert set(sampler.sample(logits, sampler.prepare(top_k)).tolist()) == {0, 1}
    # softmax of [3, 2, 1, ...]: 0.64, 0.24, 0.09: top_p 0.8 keeps the first two
    top_p = [_req(SamplingParams(temperature=1.0, top_p=0.8), seed=s) for s in range(500)]
    assert set(sampler.sample(logits, sampler.prepare(top_p)).tolist()) == {0, 1}


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(50, torch.device("cpu"))
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(8)]
    tokens = sampler.sample(
        logits, sampler.prepare([_req(p, seed=i) for i, p in enumerate(params)])
    )
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[1::2], greedy[1::2])
    assert not torch.equal(tokens[0::2], greedy[0::2])  # temperature 2 over 50 tokens


@pytest.fixture(scope="module")
def llm(tiny_dirs) -> LLM:
    return LLM(str(tiny_dirs["qwen3"]), device="cpu", page_size=4)


def test_same_seed_same_tokens_whatever_else_is_running(llm) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8 + i, ignore_eos=True) for i in range(5)]
    crowd = llm.generate(
        PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], others[:2] + [seeded] + others[2:]
    )
    assert crowd[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[2]], other_seed)[0].token_ids != alone


def test_unseeded_requests_differ_between_runs(llm) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    a = llm.generate([PROMPTS[1]], params)[0].token_ids
    b = llm.generate([PROMPTS[1]], params)[0].token_ids
    # 16 draws at temperature 1.5 over 512 tokens: equal by chance has odds below 1e-20
    assert a != b


def test_top_k_one_is_greedy(llm) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    top1 = llm.generate(
        PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]
