"""Batched sampling: greedy, temperature, top-k, top-p, seeds that do not depend on what else
shares the batch, draws that follow the distribution, and no host sync while sampling."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.engine import sample as sample_module
from minisgl.engine.sample import Sampler, greedy_tokens, seeded_uniform

PROMPTS = [[(i * 13 + j * 5) % 400 + 3 for j in range(4 + 3 * i)] for i in range(6)]
CPU = torch.device("cpu")
# upper 1e-4 quantiles of the chi-square distribution, by degrees of freedom: the draws are
# seeded, so each test is deterministic; a wrong distribution lands far above these
CHI2_LIMIT = {3: 21.11, 4: 23.51, 5: 25.74, 7: 29.88, 15: 42.58}


def _req(params: SamplingParams, seed: int = 0, step: int = 0, slot: int = 0) -> Req:
    return Req(0, [3] * (1 + step), 1, 10_000, params, seed=seed, table_idx=slot)


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws `tokens` against `probs` (zero-probability tokens
    must never be drawn)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, counts
    expected = probs.double() * len(tokens)
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _draw_many(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws from one row of logits, with seeds 0..n-1."""
    sampler = Sampler(logits.shape[-1], CPU, 1)
    args = sampler.prepare([_req(params, seed=s) for s in range(n)])
    return sampler.sample(logits.expand(n, -1).clone(), args)


# ---------------------------------------------------------------------------- randomness
def test_the_uniform_is_a_pure_function_of_seed_and_step() -> None:
    seeds = torch.tensor([1, 2, 1, -5, 2**62])
    steps = torch.tensor([0, 0, 1, 0, 3])
    u = seeded_uniform(seeds, steps)
    assert u.shape == (5,) and u.dtype == torch.float32
    assert torch.equal(u, seeded_uniform(seeds.flip(0), steps.flip(0)).flip(0))
    assert len(set(u.tolist())) == 5
    # uniform over seeds (one step) and over steps (one seed): 16 bins, 32000 draws each
    n = 32000
    for u in (
        seeded_uniform(torch.arange(n), torch.zeros(n, dtype=torch.int64)),
        seeded_uniform(torch.full((n,), 1234), torch.arange(n)),
    ):
        assert 0 < u.min() and u.max() < 1
        bins = (u * 16).long()
        assert _chi2(bins, torch.full((16,), 1 / 16)) < CHI2_LIMIT[15]


def test_sampling_follows_the_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, float("-inf")])
    for temperature in (1.0, 0.6, 2.5):
        probs = (logits / temperature).softmax(-1)
        tokens = _draw_many(logits, SamplingParams(temperature=temperature), 20000)
        assert _chi2(tokens, probs) < CHI2_LIMIT[4], temperature


def test_one_seed_over_its_steps_follows_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0])
    n = 20000
    sampler = Sampler(5, CPU, 1)
    args = sampler.prepare([_req(SamplingParams(temperature=1.0), seed=77)] * n)
    args.steps = torch.arange(n)  # as if one request sampled n tokens
    tokens = sampler.sample(logits.expand(n, -1).clone(), args)
    assert _chi2(tokens, logits.softmax(-1)) < CHI2_LIMIT[4]


def test_top_k_and_top_p_draw_from_the_renormalised_kept_tokens() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, 0.5])
    probs = logits.softmax(-1)

    def kept(*ids: int) -> torch.Tensor:
        p = torch.zeros(6)
        p[list(ids)] = probs[list(ids)]
        return p / p.sum()

    # softmax: 0.61, 0.22, 0.08, 0.03, 0.01, 0.05: top_p 0.8 keeps the first two,
    # top_p 0.9 three; top_p 0.1 only the top token
    cases = [
        (SamplingParams(temperature=1.0, top_k=3), kept(0, 1, 2)),
        (SamplingParams(temperature=1.0, top_p=0.8), kept(0, 1)),
        (SamplingParams(temperature=1.0, top_p=0.9), kept(0, 1, 2)),
        (SamplingParams(temperature=1.0, top_k=2, top_p=0.9), kept(0, 1)),
        (SamplingParams(temperature=1.0, top_k=4, top_p=0.8), kept(0, 1)),
    ]
    for params, expected in cases:
        tokens = _draw_many(logits, params, 12000)
        assert set(tokens.tolist()) == set(expected.nonzero().flatten().tolist()), params
        assert _chi2(tokens, expected) < CHI2_LIMIT[3], params
    assert set(_draw_many(logits, SamplingParams(temperature=1.0, top_p=0.1), 500).tolist()) == {0}


def test_tokens_tied_with_the_last_one_kept_stay() -> None:
    # the 2nd and 3rd logits tie: top_k=2 keeps both rather than whichever a sort puts first
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    tokens = _draw_many(logits, SamplingParams(temperature=1.0, top_k=2), 2000)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(50, CPU, 8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(8)]
    tokens = sampler.sample(
        logits, sampler.prepare([_req(p, seed=i) for i, p in enumerate(params)])
    )
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[1::2], greedy[1::2])
    assert not torch.equal(tokens[0::2], greedy[0::2])  # temperature 2 over 50 tokens


@pytest.mark.parametrize("shape", [(1, 4096), (3, 49_152), (64, 1024), (300, 4096), (5, 1000)])
def test_greedy_tokens_are_argmax_ties_nan_and_inf_included(shape) -> None:
    # shapes on both sides of the blocked path's threshold, and a vocabulary it cannot cut
    B, V = shape
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, V, generator=g).mul_(4).round_()  # coarse values: many ties
    x[0, 7] = x[0, 300 % V] = 1e6  # a tie of maxima in different blocks: the first wins
    if B > 2:
        x[1] = float("-inf")  # a row where every token is banned
        x[2, V // 2] = float("nan")  # NaN counts as the maximum, as in argmax
        x[2, V - 1] = float("nan")
    expected = x.argmax(dim=-1)
    assert torch.equal(greedy_tokens(x), expected)
    assert expected[0] == 7


def test_sample_leaves_the_logits_alone() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampler = Sampler(40, CPU, 3)
    params = [
        SamplingParams(temperature=0.7, top_p=0.5, logit_bias={3: 5.0}),
        SamplingParams(temperature=1.0, top_k=5, presence_penalty=1.0),
        SamplingParams(),
    ]
    reqs = [_req(p, seed=i, slot=i) for i, p in enumerate(params)]
    sampler.sample(logits, sampler.prepare(reqs))
    assert torch.equal(logits, before)


def test_a_rows_draw_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Each row is drawn alone, then in shuffled batches whose other rows take other paths
    (greedy, penalties, top-k, top-p: the sorting path): the same token every time."""
    V = 300
    gen = torch.Generator().manual_seed(2)
    subjects = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.7),
    ]
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.5, top_k=200, logit_bias={7: 3.0}),
        SamplingParams(temperature=2.0, frequency_penalty=0.5, top_k=3),
    ]
    for trial in range(6):
        rows = [(p, 1000 * trial + i, trial + i) for i, p in enumerate(subjects)]
        rows += [(p, 7 + i, 3) for i, p in enumerate(others)]
        logits = torch.randn(len(rows), V, generator=gen) * 3
        alone = [
            Sampler(V, CPU, 1)
            .sample(logits[i : i + 1], Sampler(V, CPU, 1).prepare([_req(p, s, t)]))
            .item()
            for i, (p, s, t) in enumerate(rows[: len(subjects)])
        ]
        for mix in range(3):
            order = torch.randperm(len(rows), generator=gen).tolist()
            sampler = Sampler(V, CPU, len(rows))
            reqs = [_req(rows[i][0], rows[i][1], rows[i][2], slot=j) for j, i in enumerate(order)]
            tokens = sampler.sample(logits[order], sampler.prepare(reqs)).tolist()
            together = {i: tokens[j] for j, i in enumerate(order)}
            assert [together[i] for i in range(len(subjects))] == alone, (trial, mix)


def test_a_draw_never_lands_on_a_token_with_zero_probability(monkeypatch) -> None:
    """The extreme uniforms: u * total may round onto the end of the cumulative sums."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 0.0, 1.0, inf, 0.5, inf, inf]] * 2)
    allowed = {1, 2, 4}
    for u in (2.0**-24, 1 - 2.0**-24, 1.0):
        monkeypatch.setattr(
            sample_module, "seeded_uniform", lambda seeds, steps, u=u: torch.full(seeds.shape, u)
        )
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=3.0, top_k=3)):
            sampler = Sampler(7, CPU, 2)
            tokens = sampler.sample(logits, sampler.prepare([_req(params, s) for s in (0, 1)]))
            assert set(tokens.tolist()) <= allowed, (u, params)


def test_sample_never_waits_for_the_device(monkeypatch) -> None:
    """No .tolist(), .item() or truth test of a tensor in sample() or logprobs_device()."""
    V = 64
    sampler = Sampler(V, CPU, 4)
    params = [
        SamplingParams(temperature=0.8, top_p=0.8, logprobs=3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=4, min_tokens=5, stop_token_ids=[2]),
        SamplingParams(logit_bias={1: 2.0}, repetition_penalty=1.2, logprobs=0),
        SamplingParams(temperature=1.2),
    ]
    args = sampler.prepare([_req(p, seed=i, slot=i) for i, p in enumerate(params)])
    logits = torch.randn(4, V)

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync")

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    tokens = sampler.sample(logits, args)
    device_part = Sampler.logprobs_device(logits, tokens, args)
    monkeypatch.undo()
    assert device_part.to_host() == Sampler.logprobs(logits, tokens, args)


def test_logprobs_report_the_raw_distribution() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(30, CPU, 3)
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)]
    args = sampler.prepare([_req(p, slot=i) for i, p in enumerate(params)])
    tokens = sampler.sample(logits, args)
    out = Sampler.logprobs(logits, tokens, args)
    logp = logits.log_softmax(-1)
    assert out[1] is None and out[2].top == []
    assert out[0].logprob == pytest.approx(logp[0, tokens[0]].item())
    top = logp[0].topk(2)
    assert [i for i, _ in out[0].top] == top.indices.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(top.values.tolist())


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def llm(tiny_dirs) -> LLM:
    return LLM(str(tiny_dirs["qwen3"]), device="cpu", page_size=4)


@pytest.fixture(scope="module")
def overlap_llm(tiny_dirs) -> LLM:
    return LLM(str(tiny_dirs["qwen3"]), device="cpu", page_size=4, overlap_schedule=True)


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


def test_penalties_give_the_same_tokens_with_overlap_and_in_a_crowd(llm, overlap_llm) -> None:
    """With overlap a step samples while the previous token is still on the device: the
    penalties must count it all the same. And each sequence's statistics stay its own."""
    # negative penalties favour what was already said: then every token counts
    penalized = [
        SamplingParams(
            max_tokens=20, ignore_eos=True, presence_penalty=-1.0, frequency_penalty=-0.5
        ),
        SamplingParams(
            temperature=1.0, seed=5, max_tokens=20, ignore_eos=True, repetition_penalty=0.5
        ),
    ]
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    sync = [o.token_ids for o in llm.generate([PROMPTS[1]] * 2, penalized)]
    assert sync[0] != llm.generate([PROMPTS[1]], plain)[0].token_ids  # the penalties bite
    crowd = overlap_llm.generate(PROMPTS[:4], [plain, penalized[0], plain, penalized[1]])
    assert [crowd[1].token_ids, crowd[3].token_ids] == [
        llm.generate([PROMPTS[1]], penalized[0])[0].token_ids,
        llm.generate([PROMPTS[3]], penalized[1])[0].token_ids,
    ]
    assert [o.token_ids for o in overlap_llm.generate([PROMPTS[1]] * 2, penalized)] == sync


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
