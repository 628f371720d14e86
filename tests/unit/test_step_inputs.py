"""StepInputBuilder: what one step feeds the model, checked against each request's own
pages and tokens (the slow, obvious way), for mixed prefill/decode batches, pending tokens
read from the device, and decode batches padded for a CUDA graph bucket."""

from __future__ import annotations

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.inputs import StepInputBuilder
from minisgl.scheduler.cache import CacheManager

PS, SLOTS, MAX_PAGES, NUM_PAGES = 4, 6, 8, 40


def _setup():
    builder = StepInputBuilder(SLOTS, MAX_PAGES, PS, NUM_PAGES, torch.device("cpu"), 8)
    cache = CacheManager(NUM_PAGES, PS)
    return builder, cache


def _req(slot: int, tokens: list[int], cached: int, extend: int, cache: CacheManager) -> Req:
    req = Req(slot, list(tokens), len(tokens), 100, SamplingParams(), seed=0)
    req.table_idx = slot
    cache.grow(req, cached + extend)
    req.cached_len, req.extend_len = cached, extend
    return req


def _expected_slot(req: Req, pos: int) -> int:
    return req.pages[pos // PS] * PS + pos % PS


def test_a_mixed_batch_matches_each_requests_pages_and_tokens() -> None:
    builder, cache = _setup()
    cache.allocator.allocate(3)  # pages out of order: requests do not start at page 0
    reqs = [
        _req(2, list(range(10, 19)), 8, 1, cache),  # decode, position 8 (a new page)
        _req(0, list(range(30, 43)), 4, 9, cache),  # prefill chunk over a cached prefix
        _req(5, list(range(50, 57)), 0, 5, cache),  # first chunk, does not sample
    ]
    builder.write_pages(cache.take_edits())
    inputs = builder.build(Batch(reqs))
    ids, pos, slots = [], [], []
    for r in reqs:
        for p in range(r.cached_len, r.cached_len + r.extend_len):
            ids.append(r.token_ids[p])
            pos.append(p)
            slots.append(_expected_slot(r, p))
    assert inputs.input_ids.tolist() == ids
    assert inputs.info.positions.tolist() == pos
    assert inputs.info.out_slots.tolist() == slots
    assert inputs.info.seq_lens.tolist() == [9, 13, 5]
    for row, r in zip(inputs.info.block_table.tolist(), reqs):
        assert row[: len(r.pages)] == r.pages
    # the first two sample (their step reaches their last token), from their last rows
    assert inputs.sample_rows.tolist() == [0, 9]
    assert inputs.sample_slots.tolist() == [2, 0]


def test_a_pending_token_is_read_from_the_device() -> None:
    builder, cache = _setup()
    a = _req(1, [5, 6, 7], 3, 1, cache)
    b = _req(3, [8, 9], 2, 1, cache)
    builder.write_pages(cache.take_edits())
    for r in (a, b):  # each sampled a token the host has not seen yet
        r.num_pending = 1
    first = builder.build(Batch([a]))  # a step that samples for slot 1 ...
    builder.record_sampled(first, torch.tensor([77]))  # ... leaves 77 on the device
    builder.last_tokens[3] = 88
    inputs = builder.build(Batch([a, b]))
    assert inputs.input_ids.tolist() == [77, 88]
    assert inputs.info.positions.tolist() == [3, 2]


def test_padded_rows_only_touch_the_scratch_page() -> None:
    builder, cache = _setup()
    reqs = [_req(s, [1, 2, 3, 4, 5], 4, 1, cache) for s in (0, 4, 2)]
    builder.write_pages(cache.take_edits())
    inputs = builder.build(Batch(reqs), pad_to=8)
    buf = builder.decode_buffers
    assert inputs.input_ids.data_ptr() == buf.input_ids.data_ptr()  # what a graph reads
    assert inputs.num_reqs == 3 and inputs.input_ids.shape[0] == 8
    scratch_slot = NUM_PAGES * PS
    assert buf.out_slots[3:8].tolist() == [scratch_slot] * 5
    assert buf.positions[3:8].tolist() == [0] * 5 and buf.seq_lens[3:8].tolist() == [1] * 5
    assert (buf.block_table[3:8] == NUM_PAGES).all()
    assert buf.out_slots[:3].tolist() == [_expected_slot(r, 4) for r in reqs]
    # a smaller step afterwards re-pads rows the bigger one had filled
    builder.build(Batch(reqs[:1]), pad_to=2)
    assert buf.out_slots[1].item() == scratch_slot and buf.seq_lens[1].item() == 1


def test_flush_writes_only_changed_rows_once() -> None:
    builder, cache = _setup()
    r = _req(4, list(range(9)), 0, 9, cache)
    builder.write_pages(cache.take_edits())
    assert builder.page_table[4, :3].tolist() == r.pages
    assert cache._edits == []
    cache.grow(r, 13)  # one more page
    builder.write_pages(cache.take_edits())
    assert builder.page_table[4, :4].tolist() == r.pages
    assert (builder.page_table[SLOTS] == NUM_PAGES).all()  # the dummy row stays scratch
