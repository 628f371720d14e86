"""Tensor parallelism on the CPU (gloo, two ranks in two processes): greedy tokens with
`tp_size=2` equal transformers' for tiny Llama, Qwen2 and Qwen3 checkpoints, and for one
with fewer KV heads than ranks and a vocabulary that does not split evenly; batched with
mixed lengths under chunked prefill; sampled tokens equal one rank's (same seeds); a
stream left early aborts on every rank; both ranks' schedulers report their state (each
from its own process) and are back at zero, and a flush empties both ranks' caches;
closing stops the other rank's process."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
from tiny import hf_references, make_checkpoint

from minisgl import LLM, SamplingParams
from minisgl.distributed import TPInfo, kv_heads, shard
from minisgl.message import SchedulerState, StateQueryMsg

ARCHS = ["llama", "qwen2", "qwen3", "llama_1kv"]
NEW_TOKENS = 10
# mixed lengths, 3..58 tokens, ids away from the special tokens
PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(3 + i * 11)] for i in range(6)]
ZERO = {"pending": 0, "running": 0, "table_slots_used": 0, "kv_pages_used": 0}


@pytest.fixture(scope="module")
def checkpoints(tiny_dirs, tmp_path_factory):
    dirs = dict(tiny_dirs)
    # one KV head for two ranks (replicated), a vocabulary of 511 rows (padded to 2 x 256)
    one_kv = tmp_path_factory.mktemp("tiny-llama-1kv")
    dirs["llama_1kv"] = make_checkpoint("llama", one_kv, num_key_value_heads=1, vocab_size=511)
    return dirs


@pytest.fixture(scope="module")
def references(checkpoints):
    return hf_references(checkpoints, ARCHS, PROMPTS, NEW_TOKENS)


def _state(llm: LLM) -> SchedulerState:
    (reply,) = llm.scheduler.process_msg(StateQueryMsg(0))
    return reply.state


def _counts(state) -> dict[str, int]:
    return {k: getattr(state, k) for k in ZERO}


def test_shards_split_heads_and_share_kv_heads_when_too_few():
    assert [shard(8, TPInfo(r, 2)) for r in range(2)] == [(0, 4), (4, 4)]
    assert [kv_heads(4, TPInfo(r, 2)) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_heads(2, TPInfo(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError):
        shard(6, TPInfo(0, 4))
    with pytest.raises(ValueError):
        kv_heads(2, TPInfo(0, 3))


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_give_transformers_greedy_tokens(arch, checkpoints, references):
    llm = LLM(str(checkpoints[arch]), device="cpu", page_size=4, max_prefill_tokens=16, tp_size=2)
    try:
        assert llm.engine.model.num_heads == 2  # of 4: this rank's half
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outs] == references[arch]
        # sampled, with seeds: the same tokens as one rank draws
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=11, n=2)
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:3], sampled)]
        state = _state(llm)
        assert [_counts(r) for r in state.ranks] == [ZERO, ZERO]
    finally:
        llm.close()
    single = LLM(str(checkpoints[arch]), device="cpu", page_size=4, max_prefill_tokens=16)
    want = [[c.token_ids for c in o.outputs] for o in single.generate(PROMPTS[:3], sampled)]
    assert got == want


def test_a_stream_left_early_aborts_on_every_rank_and_close_stops_the_other(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]), device="cpu", page_size=4, tp_size=2)
    (follower,) = llm._followers
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, _event in enumerate(llm.stream(PROMPTS[1:4], params)):
        if i == 5:
            break  # the consumer leaves: the three requests are aborted
    state = _state(llm)
    assert _counts(state) == ZERO
    assert [_counts(r) for r in state.ranks] == [ZERO, ZERO]
    # each rank's own answer, from its own process
    assert [r.rank for r in state.ranks] == [0, 1]
    assert state.ranks[0].pid == os.getpid() and state.ranks[1].pid == follower.pid
    # and the ranks still agree afterwards
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out.token_ids) == 6
    # a flush empties every rank's cache alike; each rank reports its own pages freed, and
    # the JSON of a rank's answer starts with its rank and pid, as /debug/lifecycle shows
    (reply,) = llm.scheduler.process_msg(StateQueryMsg(1, flush_cache=True))
    flushed = reply.state.flushed_pages
    assert flushed > 0 and [r.flushed_pages for r in reply.state.ranks] == [flushed, flushed]
    answer = msgspec.to_builtins(reply.state)
    assert list(answer)[-2:] == ["flushed_pages", "ranks"]
    assert list(answer["ranks"][1])[:3] == ["rank", "pid", "pending"]
    assert answer["ranks"][1]["flushed_pages"] == flushed and "ranks" not in answer["ranks"][1]
    llm.close()
    follower.join(10)
    assert not follower.is_alive() and follower.exitcode == 0
    llm.close()  # a second close is a no-op


@pytest.mark.gpu
def test_two_gpus_over_nccl_give_one_gpu_s_greedy_tokens(checkpoints):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", page_size=4, max_prefill_tokens=16)
    one = LLM(str(checkpoints["qwen3"]), **options)
    want = [o.token_ids for o in one.generate(PROMPTS, params)]
    del one
    two = LLM(str(checkpoints["qwen3"]), tp_size=2, **options)
    try:
        assert [o.token_ids for o in two.generate(PROMPTS, params)] == want
    finally:
        two.close()


def test_a_dropped_llm_releases_its_ranks_and_the_next_one_works(checkpoints, references):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    first = LLM(str(checkpoints["llama"]), device="cpu", page_size=4, tp_size=2)
    (follower,) = first._followers
    assert [o.token_ids for o in first.generate(PROMPTS[:2], params)] == references["llama"][:2]
    del first  # no close(): its finalizer stops the other rank
    follower.join(30)
    assert not follower.is_alive()
    second = LLM(str(checkpoints["llama"]), device="cpu", page_size=4, tp_size=2)
    try:
        assert [o.token_ids for o in second.generate(PROMPTS, params)] == references["llama"]
    finally:
        second.close()


def test_a_second_open_tensor_parallel_llm_is_a_clear_error_and_with_releases(checkpoints):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(checkpoints["qwen2"]), device="cpu", page_size=4, tp_size=2) as llm:
        (follower,) = llm._followers
        with pytest.raises(RuntimeError, match="another LLM with tp_size > 1 is open"):
            LLM(str(checkpoints["qwen2"]), device="cpu", page_size=4, tp_size=2)
        assert len(llm.generate([PROMPTS[1]], params)[0].token_ids) == 4  # unharmed
    follower.join(30)
    assert not follower.is_alive() and follower.exitcode == 0
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPTS[1]], params)


def test_a_stopped_rank_ends_every_request_with_an_error_within_the_timeout(checkpoints):
    import os
    import signal
    import time

    timeout = 3.0
    llm = LLM(str(checkpoints["llama"]), device="cpu", page_size=4, tp_size=2, dist_timeout=timeout)
    (follower,) = llm._followers
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    stopped = None
    try:
        for i, event in enumerate(llm.stream(PROMPTS[1:4], params)):
            if i == 3:
                os.kill(follower.pid, signal.SIGSTOP)
                stopped = time.monotonic()
            last = event
        ended = time.monotonic()
        assert stopped is not None and ended - stopped < timeout + 20, ended - stopped
        assert last.output.error is not None and "did not answer" in last.output.error
        with pytest.raises(RuntimeError, match="did not answer"):
            llm.generate([PROMPTS[1]], params)  # closed: the ranks are out of step
        follower.join(10)
        assert not follower.is_alive()  # killed, stopped as it was
    finally:
        if follower.is_alive():
            os.kill(follower.pid, signal.SIGKILL)
        llm.close()
