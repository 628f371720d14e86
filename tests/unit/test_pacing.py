"""Prefill pacing: alone, a prompt prefills in chunks of max_prefill_tokens; beside decoding
sequences, its chunks are sized from the measured speed so a step takes about the target
time (never below a floor, never above the cap); before any measurement the first chunk is
small; off, the cap always. Where the engine's projections only run as GEMMs from some
number of rows on (int4 weights), a chunk beside decodes is never smaller than what takes
the step to the rows the engine asks for. Over a real scheduler on the CPU, a long prompt
that arrives while another request decodes is prefilled in small chunks, and the decoding
request gets a token in every step."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.message import UserMsg
from minisgl.scheduler.pacing import MIN_TOKENS, PrefillPacer


def test_alone_a_prompt_takes_the_whole_budget():
    pacer = PrefillPacer(8192, 0.3)
    assert pacer.budget(0) == 8192
    pacer.observe(1000, 0, 10.0)
    assert pacer.budget(0) == 8192


def test_beside_decodes_the_chunk_fits_the_step_time():
    pacer = PrefillPacer(8192, 0.3)
    assert pacer.budget(2) == 8 * MIN_TOKENS  # nothing measured yet: small
    pacer.observe(1000, 0, 10.0)  # 10 ms a token
    assert pacer.budget(2) == 30 - 2
    for _ in range(50):  # a faster machine (1 ms a token): the estimate follows
        pacer.observe(1000, 0, 1.0)
    assert pacer.budget(2) == pytest.approx(298, abs=3)
    pacer.observe(100, 0, 100.0)  # a very slow step: the floor holds
    assert pacer.budget(2) == MIN_TOKENS
    assert PrefillPacer(64, 0.3).budget(1) == 64  # never past the cap


def test_beside_decodes_a_chunk_takes_the_step_to_the_engines_prefill_rows():
    pacer = PrefillPacer(8192, 0.3, min_rows=96)
    assert pacer.budget(16) == 8 * MIN_TOKENS  # nothing measured: the first chunk is more
    pacer.observe(30, 16, 0.3)  # 6.5 ms a token: 0.3 s holds 46 rows, 30 beside 16 decodes
    assert pacer.budget(16) == 96 - 16  # raised to 96 rows
    assert pacer.budget(90) == MIN_TOKENS  # the decodes nearly reach it: the floor
    assert pacer.budget(200) == MIN_TOKENS  # past it
    assert PrefillPacer(8192, 0.3).budget(16) == 8 * MIN_TOKENS  # 1 row: no raise
    for _ in range(50):  # a faster machine: the measured speed gives more than 96 rows
        pacer.observe(1000, 16, 1.0)
    assert pacer.budget(16) == pytest.approx(0.3 / (1.0 / 1016) - 16, abs=3)
    capped = PrefillPacer(64, 0.3, min_rows=96)
    capped.observe(30, 16, 0.3)
    assert capped.budget(16) == 64  # never past the cap


def test_pacing_off_and_decode_only_steps_change_nothing():
    off = PrefillPacer(512, None)
    off.observe(100, 0, 50.0)
    assert off.budget(5) == 512
    on = PrefillPacer(512, 0.3)
    on.observe(0, 8, 1.0)  # a decode-only step
    assert on.seconds_per_token is None


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
