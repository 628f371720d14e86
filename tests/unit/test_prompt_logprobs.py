"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`) through the offline `LLM`, against
transformers on the same tiny random checkpoints: every prompt token's logprob given the
tokens before it (the first has none) and its top k alternatives, computed in the prefill
step; equal whether the prompt is prefilled in one chunk or many, whether its prefix is in
the prefix cache or not, whether its prefill is interrupted and recomputed, with
`max_tokens=0` (score only) or with generation after it, for batched prompts and n > 1;
and nothing of them is left once the request ends or is aborted."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.message import TokenInfo, UserMsg, UserReply
from minisgl.server.buffer import ReplyBuffer
from minisgl.server.memory import text_bytes

PROMPTS = [
    [5, 17, 230, 42, 8, 99, 310, 7, 7, 64, 2, 150, 33],
    [300, 301, 12],
    [9, 8],
    list(range(20, 61)),  # 41 tokens: several chunks, several pages
]
K = 3


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    import transformers

    return {
        arch: transformers.AutoModelForCausalLM.from_pretrained(
            tiny_dirs[arch], dtype=torch.float32
        ).eval()
        for arch in ("llama", "qwen3")
    }


def hf_prompt_logprobs(model, ids: list[int], k: int):
    """transformers' (logprob of token p + 1, top-k ids, top-k values) per position p."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    values, top = logp.topk(k, dim=-1)
    return chosen.tolist(), top.tolist(), values.tolist()


def assert_matches(out, model, ids: list[int], k: int = K) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(ids)
    assert scores[0] is None  # nothing predicts the first token
    chosen, top_ids, top_values = hf_prompt_logprobs(model, ids, k)
    ours = [s.logprob for s in scores[1:]]
    assert ours == pytest.approx(chosen, abs=2e-4)
    for p, s in enumerate(scores[1:]):
        assert [t for t, _ in s.top] == top_ids[p], p
        assert [v for _, v in s.top] == pytest.approx(top_values[p], abs=2e-4)


def _llm(tiny_dirs, arch: str, **options) -> LLM:
    settings = dict(device="cpu", page_size=4, max_seq_len=128, max_running_requests=4)
    return LLM(str(tiny_dirs[arch]), **(settings | options))


def _idle(llm: LLM) -> None:
    s = llm.scheduler.state()
    assert s.pending == s.running == s.table_slots_used == s.kv_pages_used == 0, s


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scoring_a_batch_of_prompts_matches_transformers(tiny_dirs, hf_models, arch):
    llm = _llm(tiny_dirs, arch)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=K))
    for out, ids in zip(outs, PROMPTS):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == [] and out.text == ""  # max_tokens 0: nothing generated
        assert_matches(out, hf_models[arch], ids)
    _idle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_chunked_prefill_scores_as_one_chunk_does(tiny_dirs, hf_models, overlap):
    """With overlap scheduling too: the next step is launched before this one's scores
    are read, as on a GPU."""
    one = _llm(tiny_dirs, "llama", max_prefill_tokens=4096)
    # 41 tokens: 9 chunks
    chunked = _llm(tiny_dirs, "llama", max_prefill_tokens=5, overlap_schedule=overlap)
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    whole = one.generate(PROMPTS, params)
    pieces = chunked.generate(PROMPTS, params)
    generating = chunked.generate(PROMPTS, SamplingParams(max_tokens=3, prompt_logprobs=K))
    for a, b, c, ids in zip(whole, pieces, generating, PROMPTS):
        assert_matches(c, hf_models["llama"], ids)
        assert_matches(b, hf_models["llama"], ids)
        assert [s.logprob for s in a.prompt_logprobs[1:]] == pytest.approx(
            [s.logprob for s in b.prompt_logprobs[1:]], abs=1e-5
        )
    _idle(chunked)


def test_a_cached_prefix_is_recomputed_for_its_logits(tiny_dirs, hf_models):
    llm = _llm(tiny_dirs, "llama")  # the prefix cache is on by default
    ids = PROMPTS[3]
    llm.generate([ids], SamplingParams(max_tokens=1))  # leaves the prompt's pages cached
    assert llm.scheduler.policy.cache_manager.cached > 0
    again = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    assert again.cached_tokens > 0  # a request without prompt logprobs takes the hit
    scored = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=K))[0]
    assert scored.cached_tokens == 0  # a scoring one recomputes every position
    assert_matches(scored, hf_models["llama"], ids)
    _idle(llm)


def test_generation_after_scoring_and_every_choice(tiny_dirs, hf_models):
    llm = _llm(tiny_dirs, "llama")
    ids = PROMPTS[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=0, n=2)
    out = llm.generate([ids], params)[0]
    assert_matches(out, hf_models["llama"], ids, k=0)
    assert all(len(o.token_ids) == 4 and len(o.logprobs) == 4 for o in out.outputs)
    # the same prompt scored alone gives the same values
    alone = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert [s.logprob for s in out.prompt_logprobs[1:]] == pytest.approx(
        [s.logprob for s in alone.prompt_logprobs[1:]], abs=1e-5
    )
    scored_n = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1, n=3))[0]
    assert [o.finish_reason for o in scored_n.outputs] == ["length"] * 3
    _idle(llm)


def test_a_prefill_interrupted_and_recomputed_scores_each_position_once(tiny_dirs, hf_models):
    """A partly prefilled sequence that gives its pages back (to make room for decodes)
    starts over; the positions it already scored are not scored again."""
    llm = _llm(tiny_dirs, "llama", max_prefill_tokens=8)
    sched = llm.scheduler
    ids = PROMPTS[3]
    assert not sched.process_msg(
        UserMsg.make(0, ids, SamplingParams(max_tokens=0, prompt_logprobs=K))
    )
    sched.step()
    sched.step()  # 16 of 41 tokens prefilled, 16 positions scored
    (req,) = sched.policy.prefill_manager.pending
    assert req.prompt_scores.launched == 16 and len(req.prompt_scores.values) == 16
    sched.policy._take_back(req)  # what _make_room_for_decode does to it
    assert req.cached_len == 0
    replies = []
    while sched.has_work:
        replies += sched.step()
    (end,) = replies
    assert end.next_token is None and end.finish_reason == "length"
    assert len(end.prompt_logprobs) == len(ids) - 1
    chosen, _, _ = hf_prompt_logprobs(hf_models["llama"], ids, K)
    assert [s.logprob for s in end.prompt_logprobs] == pytest.approx(chosen, abs=2e-4)
    _idle(llm)


def test_aborting_mid_prefill_frees_the_scores_with_the_request(tiny_dirs):
    llm = _llm(tiny_dirs, "llama", max_prefill_tokens=8)
    events = llm.stream([PROMPTS[3]] * 2, SamplingParams(max_tokens=0, prompt_logprobs=K))
    next(events)  # the first prompt ended; the second is still being prefilled
    events.close()
    _idle(llm)
    assert sched_reqs(llm) == []


def sched_reqs(llm: LLM) -> list:
    s = llm.scheduler
    return [*s.policy.prefill_manager.pending, *s.policy.decode_manager.running.values()]


def test_prompt_logprobs_do_not_count_against_the_slow_client_cap():
    """They arrive once, sized by the prompt (the request's own): the cap bounds output
    piling up unread, so only the output's text and logprobs count."""
    buffer = ReplyBuffer()
    infos = [TokenInfo("a", b"a", -1.0, i, [("b", b"b", -2.0)] * 20) for i in range(1000)]
    assert buffer.append(UserReply(0, "x", prompt_logprobs=infos, completion_tokens=1))
    assert buffer.pending_bytes == text_bytes("x")  # the text alone
    assert len(buffer.take().choices[0].logprobs) == 1000


def test_out_of_range_prompt_logprobs_is_refused(tiny_dirs):
    llm = _llm(tiny_dirs, "llama")
    (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=0, prompt_logprobs=21))
    assert out.error and "prompt_logprobs" in out.error
    _idle(llm)
