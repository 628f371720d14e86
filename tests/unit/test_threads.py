"""The CPU engine's thread count per step (minisgl/engine/threads.py): the choice follows
the measured step times, and the tokens do not depend on it.

The choice is driven here by a fake clock (each step "takes" what the scenario says for the
count it ran on), the one way to make a neighbour start and stop on cue; the last test
runs the embedded model on both counts for real."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine import threads
from minisgl.engine.threads import MAX_EVERY, PROBE_EVERY, ThreadChoice


class Scenario:
    """A ThreadChoice of 1 or 2 threads whose steps take `cost[count]` seconds."""

    def __init__(self, narrow_s: float, wide_s: float) -> None:
        self.cost = {1: narrow_s, 2: wide_s}
        self.now = 0.0
        self.set_calls: list[int] = []
        self.choice = ThreadChoice(1, 2, self.set_calls.append, lambda: self.now)

    def run(self, steps: int, tokens: int = 1) -> list[int]:
        """The count each of `steps` steps ran on."""
        ran = []
        for _ in range(steps):
            with self.choice.step(tokens) as n:
                self.now += self.cost[n]
            ran.append(n)
        return ran


def test_the_faster_count_leads_after_two_steps_of_each():
    s = Scenario(narrow_s=0.024, wide_s=0.017)  # an idle machine: wide is faster
    assert s.run(4) == [1, 1, 2, 2]
    assert s.choice.leader(1) == 2 and s.choice.current == 2
    later = s.run(PROBE_EVERY)
    assert later == [2] * PROBE_EVERY  # no retry before PROBE_EVERY steps
    assert s.set_calls[0] == 1  # the narrow count is set when the chooser is made


def test_a_neighbour_sends_it_back_to_the_narrow_count_at_once_and_back_when_it_leaves():
    s = Scenario(narrow_s=0.024, wide_s=0.017)
    s.run(4 + 10)
    s.cost[2] = 0.172  # another process takes a core: the wide count stalls
    ran = s.run(4)
    assert ran == [2, 2, 1, 1]  # two slow steps, then the narrow count is retried and wins
    assert s.choice.leader(1) == 1
    s.cost[2] = 0.017  # it leaves again: the next retry finds the wide count faster
    ran = s.run(4 * PROBE_EVERY)
    assert ran[-1] == 2 and s.choice.leader(1) == 2


def test_retries_of_a_slower_wide_count_back_off_and_end_after_one_slow_step():
    s = Scenario(narrow_s=0.024, wide_s=0.172)  # a busy machine from the start
    ran = s.run(4 + 8 * MAX_EVERY)
    assert s.choice.leader(1) == 1
    retries = [i for i, n in enumerate(ran) if n == 2][2:]  # after the first two
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps[0] >= PROBE_EVERY and gaps == sorted(gaps)  # intervals grow...
    assert max(gaps) <= MAX_EVERY + 1  # ...up to MAX_EVERY
    assert all(b - a > 1 for a, b in zip(retries, retries[1:]))  # one step per retry


def test_one_slow_step_is_noise_and_a_slower_machine_for_both_settles():
    s = Scenario(narrow_s=0.024, wide_s=0.017)
    s.run(4 + 10)
    s.cost[2] = 0.172
    assert s.run(1) == [2]
    s.cost[2] = 0.017  # a single spike: no retry
    assert s.run(5) == [2] * 5
    s.cost = {1: 0.060, 2: 0.040}  # everything slower, wide still the faster
    ran = s.run(4 + PROBE_EVERY)
    assert ran[:4] == [2, 2, 1, 1] and set(ran[4:]) == {2}  # one retry, then it settles
    assert s.choice.leader(1) == 2


def test_each_size_of_step_chooses_alone():
    s = Scenario(narrow_s=0.024, wide_s=0.017)
    s.run(4, tokens=1)
    s.cost = {1: 0.3, 2: 0.5}  # say a prefill of 158 tokens is faster on one thread
    s.run(4, tokens=158)
    assert s.choice.leader(1) == 2 and s.choice.leader(158) == 1
    assert s.choice.leader(4) is None  # never seen


def test_nothing_is_chosen_where_there_is_no_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # keep this process's
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    choice = ThreadChoice.for_cpu(cpu)
    assert (choice.narrow, choice.wide) == (1, 2)
    assert ThreadChoice.for_cpu(torch.device("cuda")) is None
    assert ThreadChoice.for_cpu(cpu, ranks=2) is None  # tensor-parallel ranks share cores
    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert ThreadChoice.for_cpu(cpu) is None
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert (ThreadChoice.for_cpu(cpu).narrow, ThreadChoice.for_cpu(cpu).wide) == (6, 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's count stands
    assert ThreadChoice.for_cpu(cpu) is None


@pytest.fixture
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_the_embedded_models_tokens_and_logprobs_are_the_same_on_either_count(restore_threads):
    """Greedy decoding of a batch of three (the helper thread splits batched rows on one
    thread; torch divides them on two) and of one request, with logprobs: bit for bit."""
    llm = LLM(device="cpu", max_running_requests=3, max_seq_len=256)
    assert (
        llm.engine.runner.threads is not None or torch.get_num_threads() > 1
    )  # a choice, or fixed
    llm.engine.runner.threads = None  # the count is set by hand below
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    got = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
        got[n] = [
            (o.outputs[0].token_ids, [(p.logprob, p.top) for p in o.outputs[0].logprobs])
            for o in outs
        ]
    assert got[1] == got[2]


def test_the_helper_thread_computes_on_one_torch_thread(restore_threads):
    """A thread's OpenMP count is its own; the helper's must not start at every core (its
    team would spin beside the caller's two-thread steps)."""
    from minisgl.utils import split

    torch.set_num_threads(2)
    assert split._helper_thread().submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2  # the caller's count is left alone
