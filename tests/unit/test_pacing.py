"""Prefill pacing: a step's prompt chunks are sized from the measured speed so the step
takes about the target time, the decoding sequences' own work included, and a row deep in a
long prompt costs more (its attention over the positions before it), so chunks shrink as a
prompt goes on; a step with nobody decoding and one prompt waiting may take a few targets;
before any measurement the first chunk is small; off, every step may take the cap. Where
the engine's projections only run as GEMMs from some number of rows on (int4 weights), a
chunk is raised to the rows the engine asks for, but only while that step stays under the
ceiling: no floor holds a step far past the target. Over a real scheduler on the CPU, a
long prompt that arrives while another request decodes is prefilled in small chunks, and
the decoding request gets a token in every step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from minisgl import LLM, SamplingParams
from minisgl.message import UserMsg
from minisgl.scheduler.pacing import (
    ALONE,
    CEILING,
    MIN_TOKENS,
    PrefillPacer,
    row_work,
    rows_within,
)


def _step(prefill: list[tuple[int, int]], decodes: list[int]) -> SimpleNamespace:
    """A launched batch: decodes at these positions, then (rows, position) prompt chunks."""
    reqs = [SimpleNamespace(extend_len=1, cached_len=c) for c in decodes]
    reqs += [SimpleNamespace(extend_len=n, cached_len=c) for n, c in prefill]
    return SimpleNamespace(reqs=reqs, decodes=len(decodes))


def _decoding(*positions: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(cached_len=c) for c in positions]


def test_rows_within_inverts_the_work_of_a_chunk():
    for a in (math.inf, 500.0, 3072.0):
        for context in (0, 100, 7000):
            for work in (0.5, 1, 17, 300, 5000):
                rows = rows_within(work, context, a)
                assert row_work(rows, context, a) <= work < row_work(rows + 1, context, a)


def test_pacing_off_and_decode_only_steps_change_nothing():
    off = PrefillPacer(512, None)
    off.observe(_step([(100, 0)], []), 50.0)
    assert off.budget(_decoding(5, 9)).rows_at(4000) == 512
    on = PrefillPacer(512, 0.3)
    on.observe(_step([], [10] * 8), 1.0)  # a decode-only step
    assert on.seconds_per_row is None
    assert on.budget(_decoding(1)).rows_at(0) == 8 * MIN_TOKENS  # a cautious first chunk


def test_chunks_come_from_the_target_with_the_decodes_work_taken_off():
    pacer = PrefillPacer(8192, 0.3)
    pacer.observe(_step([(1000, 0)], []), 10.0)  # 10 ms a row
    assert pacer.budget(_decoding(3, 3)).rows_at(0) == 30 - 2
    for _ in range(30):
        pacer.observe(_step([(1000, 0)], []), 1.0)
    assert pacer.budget(_decoding(3, 3)).rows_at(0) == pytest.approx(298, abs=3)
    pacer.observe(_step([(100, 0)], []), 100.0)  # a very slow step: the progress floor
    assert pacer.budget(_decoding(3, 3)).rows_at(0) == MIN_TOKENS
    assert PrefillPacer(8192, 0.3).budget().rows_at(0) == 8 * MIN_TOKENS
    assert PrefillPacer(64, 0.3).budget().rows_at(0) == 64  # the cautious first chunk too
    capped = PrefillPacer(64, 0.3)
    capped.observe(_step([(30, 0)], [0] * 16), 0.001)
    assert capped.budget(_decoding(1)).rows_at(0) == 64  # never past the cap


def test_a_row_deep_in_a_long_prompt_costs_its_attention():
    pacer = PrefillPacer(8192, 0.3, attention_context=1000)
    pacer.observe(_step([(300, 0)], []), 0.3 * row_work(300, 0, 1000) / 300)  # 1 ms a row at 0
    early = pacer.budget(_decoding(0)).rows_at(0)
    late = pacer.budget(_decoding(0)).rows_at(7000)
    assert early == rows_within(300 - 1, 0, 1000) and late < early / 6
    # the late chunk's work still fits the target: it is the step's time, not its rows
    assert row_work(late, 7000, 1000) <= 299 < row_work(late + 1, 7000, 1000)
    # decodes deep in their contexts cost their attention too (6 rows' work each)
    assert pacer.budget(_decoding(5000, 5000)).rows_at(0) == rows_within(300 - 12, 0, 1000)


def test_the_speed_estimate_counts_the_attention_of_each_row():
    pacer = PrefillPacer(8192, 0.3, attention_context=1000)
    work = row_work(100, 1000, 1000) + 4 * row_work(1, 3000, 1000)
    pacer.observe(_step([(100, 1000)], [3000] * 4), 0.5)
    assert pacer.seconds_per_row == pytest.approx(0.5 / work)


def test_with_nobody_decoding_and_one_prompt_waiting_a_step_may_take_a_few_targets():
    pacer = PrefillPacer(8192, 0.3)
    pacer.observe(_step([(100, 0)], []), 0.1)  # 1 ms a row
    assert pacer.budget([], waiting=1).rows_at(0) == pytest.approx(ALONE * 300, abs=2)
    assert pacer.budget([], waiting=2).rows_at(0) == pytest.approx(300, abs=2)


def test_the_engines_rows_are_a_floor_only_while_the_step_stays_under_the_ceiling():
    pacer = PrefillPacer(8192, 0.3, min_rows=384, attention_context=1000)
    pacer.observe(_step([(100, 0)], []), 0.1 * row_work(100, 0, 1000) / 100)  # 1 ms a row
    decodes = _decoding(*[0] * 16)
    # at the start of a prompt 384 rows fit in CEILING targets: the step is raised to them
    assert row_work(384 - 16, 0, 1000) + 16 <= CEILING * 300
    assert pacer.budget(decodes).rows_at(0) == 384 - 16
    # deep in it they would take several seconds: the target wins
    deep = pacer.budget(decodes).rows_at(6000)
    assert deep < 384 - 16 and row_work(deep, 6000, 1000) <= 300 - 16
    # decodes past the target: the progress floor, never the engine's rows
    assert pacer.budget(_decoding(*[0] * 400)).rows_at(0) == MIN_TOKENS
    # the floor is per step: a second chunk in the same step gets what is left
    budget = pacer.budget(decodes)
    budget.spend(budget.rows_at(0), 0)
    assert budget.rows_at(0) == 0


def test_a_long_prompt_beside_a_decoding_request_is_prefilled_in_paced_chunks(tmp_path):
    from tiny import make_checkpoint

    model = make_checkpoint("llama", tmp_path, max_position_embeddings=2048)
    llm = LLM(str(model), device="cpu", page_size=4)
    sched = llm.scheduler
    sched.pacer.step_seconds = 1e-9  # any measured speed gives the floor
    sched.process_msg(UserMsg.make(1, [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True)))
    sched.step()  # it is decoding now
    assert (
        sched.process_msg(
            UserMsg.make(2, [3 + i % 500 for i in range(1000)], SamplingParams(max_tokens=1))
        )
        == []
    )
    (long,) = [r for r in sched.policy.prefill_manager.pending if r.uid == 2]
    chunks, decoded = [], 0
    while not long.ended:
        before = long.cached_len
        replies = sched.step()
        decoded += sum(1 for r in replies if r.uid == 1)
        chunks.append((long.prompt_len if long.ended else long.cached_len) - before)
        assert decoded == len(chunks)  # the decoding request got a token every step
    # the first step (request 1's prefill) measured the speed: the floor from then on
    assert sum(chunks) == 1000 and set(chunks[:-1]) == {MIN_TOKENS}, chunks
    sched.abort_req(1)
    while sched.has_work:
        sched.step()
    assert sched.state().kv_pages_used == 0
