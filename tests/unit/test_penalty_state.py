"""Penalties from the device-side PenaltyState equal penalties computed from scratch from
every token of each sequence, step after step: with the latest token still pending (overlap
scheduling), when a slot passes to another sequence, and when a sequence moves slots."""

from __future__ import annotations

from collections import Counter

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.logits import PenaltyState
from minisgl.engine.sample import Sampler

V = 16  # a small vocabulary, so that tokens repeat
CPU = torch.device("cpu")


def _req(uid: int, prompt: list[int], params: SamplingParams, slot: int) -> Req:
    return Req(uid, list(prompt), len(prompt), 10_000, params, seed=uid, table_idx=slot)


def reference(logits: torch.Tensor, reqs: list[Req], tokens_of) -> torch.Tensor:
    """What the processors must make of `logits`, element by element from the full token
    lists (`tokens_of(r)`: prompt and every sampled token, a pending one included)."""
    x = logits.clone()
    for i, r in enumerate(reqs):
        p, full = r.sampling_params, tokens_of(r)
        for t, b in p.logit_bias.items():
            x[i, t] += b
        if len(full) - r.prompt_len < p.min_tokens:
            for t in r.stop_token_set:
                x[i, t] = float("-inf")
        for t in set(full):
            v = x[i, t]
            x[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, c in Counter(full[r.prompt_len :]).items():
            x[i, t] -= p.presence_penalty + p.frequency_penalty * c
    return x


class Driver:
    """Drives a Sampler the way the scheduler does with overlap: a step is launched (its
    tokens sampled on the device, pending) before the previous step's tokens reach the
    host. Every step it checks the processed logits against `reference`."""

    def __init__(self, slots: int = 4) -> None:
        self.sampler = Sampler(V, CPU, slots)
        self.gen = torch.Generator().manual_seed(0)
        self.in_flight: list[tuple[Req, int]] = []
        self.checked = 0

    def tokens_of(self, r: Req) -> list[int]:
        return r.token_ids + [t for q, t in self.in_flight if q is r]

    def step(self, batch: list[Req]) -> None:
        logits = torch.randn(len(batch), V, generator=self.gen) * 3
        args = self.sampler.prepare(batch)
        expected = reference(logits, batch, self.tokens_of)
        got = logits if args.processors is None else args.processors.apply(logits.clone())
        torch.testing.assert_close(got, expected)
        self.checked += 1
        tokens = self.sampler.sample(logits, args).tolist()
        for r in batch:
            r.num_pending += 1
        self.finish()  # the previous step's tokens reach the host
        self.in_flight = list(zip(batch, tokens))

    def finish(self) -> None:
        """Read the last launched step (what the scheduler does before a preemption)."""
        for r, t in self.in_flight:
            r.append_token(t)
        self.in_flight = []


PENALIZED = [
    SamplingParams(
        temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.7
    ),
    SamplingParams(frequency_penalty=-0.4, repetition_penalty=0.8, logit_bias={3: 2.0}),
    SamplingParams(
        temperature=0.7,
        presence_penalty=-1.0,
        min_tokens=6,
        stop_token_ids=[5],
        top_k=6,
    ),
]


def test_penalties_match_the_full_token_lists_with_a_pending_token() -> None:
    d = Driver()
    a = _req(1, [1, 2, 3, 1], PENALIZED[0], slot=0)
    b = _req(2, [4, 4, 9], SamplingParams(temperature=1.0), slot=1)  # no penalties
    c = _req(3, [7], PENALIZED[1], slot=2)  # greedy
    e = _req(4, [5, 6, 8, 8], PENALIZED[2], slot=3)
    for _ in range(12):
        d.step([a, b, c, e])  # from the second step on, each has a pending token
    d.step([c])  # a greedy-only batch records its token too
    d.step([a, c, e])
    d.finish()
    d.step([e, a])
    assert d.checked == 15 and a.output_len == 14


def test_a_slot_passed_to_another_sequence_starts_afresh() -> None:
    d = Driver()
    a = _req(1, [1, 2, 3], PENALIZED[0], slot=0)
    b = _req(2, [4, 5], PENALIZED[1], slot=1)
    for _ in range(6):
        d.step([a, b])
    d.finish()  # a finishes; its slot goes to c, which never saw a's tokens
    c = _req(3, [10, 11, 12, 13], PENALIZED[0], slot=0)
    for _ in range(6):
        d.step([b, c])
    d.finish()  # c gives the slot to one without penalties, then to `fresh`
    plain = _req(4, [2], SamplingParams(temperature=1.0), slot=0)
    for _ in range(3):
        d.step([plain, b])
    d.finish()
    fresh = _req(5, [14, 15], PENALIZED[2], slot=0)
    for _ in range(4):
        d.step([fresh, b])


def test_a_sequence_that_moves_slots_and_comes_back_is_rebuilt() -> None:
    d = Driver()
    a = _req(1, [1, 2, 3], PENALIZED[0], slot=0)
    for _ in range(4):
        d.step([a])
    d.finish()  # preempted; recomputed in slot 2 (its tokens are all on the host now)
    a.table_idx = 2
    for _ in range(4):
        d.step([a])
    d.finish()  # preempted again, back in slot 0: that row misses what it sampled in slot 2
    a.table_idx = 0
    for _ in range(4):
        d.step([a])
    d.finish()
    a.table_idx = 0  # preempted and re-admitted in the same slot: the row is still its own
    d.step([a])


def test_a_row_is_built_once_per_sequence_and_slot(monkeypatch) -> None:
    built: list[int] = []
    original = PenaltyState._build

    def spy(self, reqs):
        built.extend(r.uid for r in reqs)
        original(self, reqs)

    monkeypatch.setattr(PenaltyState, "_build", spy)
    d = Driver()
    a = _req(1, [1, 2], PENALIZED[0], slot=0)
    b = _req(2, [3], PENALIZED[1], slot=1)
    c = _req(3, [4], SamplingParams(temperature=1.0), slot=2)
    for _ in range(5):
        d.step([a, b, c])
    assert built == [1, 2]
    assert d.sampler.penalties.counts.shape == (4, V)


def test_the_state_is_allocated_only_for_penalties() -> None:
    d = Driver()
    d.step([_req(1, [1, 2], SamplingParams(temperature=1.0, logit_bias={1: 1.0}), slot=0)])
    assert d.sampler.penalties.counts is None
