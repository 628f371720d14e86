"""The radix prefix cache with real (tiny) models: the same tokens with the cache on and
off for Llama, Qwen2 and Qwen3 whatever shares a prefix with what and when, prefixes that
are really reused (counted in prefill tokens, not timed), and aborts that leave the other
holders of a shared prefix alone."""

from __future__ import annotations

import pytest
from tiny import tiny_cpu_engine

from minisgl import LLM, SamplingParams
from minisgl.message import DetokenizeMsg, UserMsg
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig

ARCHS = ["llama", "qwen2", "qwen3"]
PS = 4
# a shared "system prompt" of 22 tokens: it ends in the middle of a page (22 = 5 * 4 + 2)
SYSTEM = [(j * 7) % 500 + 3 for j in range(22)]
TAILS = [[(i * 31 + j * 13) % 500 + 3 for j in range(2 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _llm(tiny_dirs, arch: str, cache: str, **options) -> LLM:
    return LLM(str(tiny_dirs[arch]), device="cpu", page_size=PS, prefix_cache=cache, **options)


def _tokens(outs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _conversation(llm: LLM, turns: int = 3) -> list[list[int]]:
    """A multi-turn chat in token ids: each turn resends the whole history plus a question."""
    history, answers = list(SYSTEM), []
    for t in range(turns):
        history += TAILS[t]
        (out,) = llm.generate([history], GREEDY)
        answers.append(out.token_ids)
        history += out.token_ids
    return answers


def _workload(llm: LLM) -> list:
    """Every way of sharing the cache's tests ask for, run in order on one LLM."""
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    return [
        # requests sharing a prefix in the same batch
        _tokens(llm.generate([SYSTEM + t for t in TAILS[:3]], GREEDY)),
        # one after the other: the later ones find the earlier ones' pages
        _tokens(llm.generate([SYSTEM + TAILS[3]], GREEDY)),
        _tokens(llm.generate([SYSTEM + TAILS[4]], GREEDY)),
        # a prompt that is all prefix, and one that is shorter than the cached prefix
        _tokens(llm.generate([SYSTEM, SYSTEM[:9]], GREEDY)),
        # n > 1: the choices share their prompt's pages on top of the cache's
        _tokens(llm.generate([SYSTEM + TAILS[5]], sampled)),
        _conversation(llm),
    ]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_cache_changes_no_token(arch, overlap, tiny_dirs) -> None:
    on = _llm(tiny_dirs, arch, "radix", overlap_schedule=overlap)
    off = _llm(tiny_dirs, arch, "none", overlap_schedule=overlap)
    assert _workload(on) == _workload(off)
    cache = on.scheduler.policy.cache_manager
    assert cache.hit_tokens > 0 and off.scheduler.policy.cache_manager.hit_tokens == 0
    assert cache.used == 0 and cache.cached == cache.nodes > 0  # held by the cache alone


@pytest.mark.parametrize("arch", ARCHS)
def test_eviction_and_preemption_together_change_no_token(arch, tiny_dirs) -> None:
    # 36 pages of 4 tokens: the cached prefixes of the first batch must be evicted for the
    # second, which then still preempts (8 sequences of 24 to 42 tokens need up to 88 pages)
    prompts = [SYSTEM + t for t in TAILS] + [SYSTEM[3:] + t for t in TAILS[:2]]
    outs = {}
    for cache in ("radix", "none"):
        llm = _llm(tiny_dirs, arch, cache, num_pages=36)
        first = _tokens(llm.generate(prompts[:4], GREEDY))
        outs[cache] = first + _tokens(llm.generate(prompts, GREEDY))
        state = llm.scheduler.state()
        assert state.kv_pages_used == 0 and state.table_slots_used == 0
        assert llm.scheduler.policy.num_preemptions > 0
        if cache == "radix":
            assert llm.scheduler.policy.cache_manager.evicted_pages > 0
            assert llm.scheduler.policy.cache_manager.hit_tokens > 0
    assert outs["radix"] == outs["none"]


def _count_prefill(llm: LLM) -> list[int]:
    """Prompt tokens computed per step, recorded as the engine launches each step."""
    prefilled: list[int] = []
    launch = llm.engine.launch

    def counting(batch):
        prefilled.append(sum(r.extend_len for r in batch.reqs[batch.decodes :]))
        return launch(batch)

    llm.engine.launch = counting
    return prefilled


def test_a_cached_prefix_is_not_prefilled_again(tiny_dirs) -> None:
    llm = _llm(tiny_dirs, "qwen3", "radix")
    prefilled = _count_prefill(llm)
    (first,) = llm.generate([SYSTEM + TAILS[2]], GREEDY)
    first_prefill, prefilled[:] = sum(prefilled), []
    (second,) = llm.generate([SYSTEM + TAILS[3]], GREEDY)
    # the first five pages (20 tokens) of the shared 22 are reused; the tails differ
    assert first.cached_tokens == 0 and first_prefill == len(SYSTEM + TAILS[2])
    assert second.cached_tokens == 20
    assert sum(prefilled) == len(SYSTEM + TAILS[3]) - 20
    # a later turn of the conversation finds its whole history (in whole pages)
    history = SYSTEM + TAILS[2] + first.token_ids
    (turn,) = llm.generate([history + TAILS[4]], GREEDY)
    computed = len(SYSTEM + TAILS[2]) + len(first.token_ids) - 1  # the last was never fed
    assert turn.cached_tokens == computed // PS * PS


@pytest.mark.parametrize("budget", [8192, 12], ids=["one_chunk", "chunked"])
def test_requests_arriving_together_compute_their_shared_prefix_once(budget, tiny_dirs) -> None:
    # four requests with the same 22-token prefix in one generate call: the first computes
    # it, the others wait a step for its pages (20 tokens: five full pages) and reuse them
    llm = _llm(tiny_dirs, "llama", "radix", max_prefill_tokens=budget)
    prefilled = _count_prefill(llm)
    prompts = [SYSTEM + t for t in TAILS[:4]]
    outs = llm.generate(prompts, GREEDY)
    assert sum(prefilled) == sum(len(p) for p in prompts) - 3 * 20
    assert [o.cached_tokens for o in outs] == [0, 20, 20, 20]
    # the same with the first two pages cached already: the later ones wait, then reuse all
    llm.scheduler.flush_cache()
    llm.generate([SYSTEM[:9]], GREEDY)  # caches SYSTEM[:8]
    prefilled[:] = []
    outs = llm.generate(prompts, GREEDY)
    assert [o.cached_tokens for o in outs] == [8, 20, 20, 20]
    assert sum(prefilled) == sum(len(p) for p in prompts) - 8 - 3 * 20
    off = _llm(tiny_dirs, "llama", "none", max_prefill_tokens=budget)
    assert _tokens(outs) == _tokens(off.generate(prompts, GREEDY))


@pytest.mark.parametrize("abort_at", [1, 3, 8], ids=lambda s: f"step{s}")
def test_aborting_one_of_two_sharers_leaves_the_other_alone(abort_at, tiny_dirs) -> None:
    # with 8 prefill tokens per step the two prompts are still prefilling at step 1 and 3
    def scheduler(cache: str) -> Scheduler:
        engine = tiny_cpu_engine(tiny_dirs["llama"], max_seq_len=128)
        return Scheduler(engine, SchedulerConfig(max_prefill_tokens=8, prefix_cache=cache))

    def run(sched: Scheduler, uids: list[int], abort: int | None) -> list[int]:
        for uid in uids:
            sched.process_msg(UserMsg.make(uid, SYSTEM + TAILS[uid], GREEDY))
        tokens, steps = [], 0
        while sched.has_work:
            steps += 1
            if steps == abort_at and abort is not None:
                sched.abort_req(abort)
            for reply in sched.advance():
                if isinstance(reply, DetokenizeMsg) and reply.uid == uids[-1]:
                    tokens.append(reply.next_token)
        return tokens

    alone = run(scheduler("none"), [2], None)
    shared = scheduler("radix")
    run(shared, [0], None)  # leaves the prefix cached
    assert run(shared, [1, 2], abort=1) == alone
    state = shared.state()
    assert state.kv_pages_used == 0 and state.table_slots_used == 0
    assert state.kv_pages_cached == state.prefix_cache_nodes > 0


def test_cached_prefixes_are_shared_only_between_equal_salts(tiny_dirs) -> None:
    from dataclasses import replace

    llm = _llm(tiny_dirs, "llama", "radix")
    alice, bob = replace(GREEDY, cache_salt="alice"), replace(GREEDY, cache_salt="bob")
    (first,) = llm.generate([SYSTEM + TAILS[0]], alice)
    # the same prefix: found under the same salt only, arriving apart or together
    (other,) = llm.generate([SYSTEM + TAILS[1]], bob)
    (unsalted,) = llm.generate([SYSTEM + TAILS[1]], GREEDY)
    (same,) = llm.generate([SYSTEM + TAILS[2]], alice)
    assert (first.cached_tokens, other.cached_tokens, unsalted.cached_tokens) == (0, 0, 0)
    assert same.cached_tokens == 20
    together = llm.generate(
        [SYSTEM + TAILS[3], SYSTEM + TAILS[4]], [replace(GREEDY, cache_salt="carol"), bob]
    )
    assert [o.cached_tokens for o in together] == [0, 20]  # bob's own pages from before
    # the salt changes which pages are reused, never a token
    off = _llm(tiny_dirs, "llama", "none")
    assert _tokens(together) == _tokens(
        off.generate([SYSTEM + TAILS[3], SYSTEM + TAILS[4]], GREEDY)
    )
