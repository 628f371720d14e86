"""Sequences: a fixed set of greedy sequences driven through the engine, without a scheduler.

Contract: `Sequences(engine, prompts, max_new)` gives sequence i table slot i and pages of
its own (consecutive from page 0, written into the engine's page table), enough for its
prompt and `max_new` tokens. `generate(overlap)` prefills every prompt in one step, then
decodes them together, and returns each sequence's `max_new` tokens. With `overlap` each
step is launched before the previous one's tokens are read, exactly as the scheduler's
overlapped loop does: the pending token is read on the device (engine/inputs.py). It is
for the start-up self-check (overlapped tokens against synchronous ones) and for `doctor`'s
throughput probe, at start-up or on an idle engine: it takes slots and pages that no
request may hold meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.kvcache import pages_for

if TYPE_CHECKING:  # the engine runs these sequences; they only name its types
    from .engine import Engine, StepHandle


def consecutive_pages(table: torch.Tensor, lengths: list[int], page_size: int) -> int:
    """Row i of the page `table` gets pages of its own for `lengths[i]` tokens, consecutive
    from page 0 in row order (a row of length 0 gets none). Returns how many that took."""
    first = 0
    for row, n in enumerate(lengths):
        count = pages_for(n, page_size)
        table[row, :count] = torch.arange(first, first + count, dtype=torch.int32,
                                          device=table.device)  # fmt: skip
        first += count
    return first


class Sequences:
    def __init__(self, engine: Engine, prompts: list[list[int]], max_new: int) -> None:
        ps = engine.page_size
        counts = [pages_for(len(p) + max_new, ps) for p in prompts]
        if len(prompts) > engine.config.max_running_requests or sum(counts) > engine.num_pages:
            raise ValueError(f"{len(prompts)} sequences of up to {max(counts) * ps} tokens "
                             "do not fit this engine's slots and pages")  # fmt: skip
        if max(len(p) for p in prompts) + max_new > engine.max_seq_len:
            raise ValueError(f"sequences longer than the engine's {engine.max_seq_len} tokens")
        self.engine, self.prompts, self.max_new = engine, prompts, max_new
        consecutive_pages(engine.page_table, [len(p) + max_new for p in prompts], ps)
        self.reqs: list[Req] = []
        # perf_counter() when the last generate() read its prefill step's tokens, and ended
        self.prefilled_at = self.finished_at = 0.0

    def generate(self, overlap: bool) -> list[list[int]]:
        greedy = SamplingParams(max_tokens=self.max_new, ignore_eos=True)
        self.reqs = [
            Req(uid=i, token_ids=list(p), prompt_len=len(p), max_len=len(p) + self.max_new,
                sampling_params=greedy, seed=0, table_idx=i)
            for i, p in enumerate(self.prompts)
        ]  # fmt: skip
        self.prefilled_at = 0.0
        pending: StepHandle | None = self._launch(decode=False)
        if not overlap:
            self._read(pending)
            pending = None
        for _ in range(self.max_new - 1):
            handle = self._launch(decode=True)  # the previous step's tokens may be pending
            if pending is not None:
                self._read(pending)
            pending = handle
            if not overlap:
                self._read(handle)
                pending = None
        if pending is not None:
            self._read(pending)
        self.finished_at = time.perf_counter()
        return [r.output_ids for r in self.reqs]

    def _launch(self, decode: bool) -> StepHandle:
        """One step for every sequence; their host state moves on as the scheduler's does."""
        for r in self.reqs:
            r.extend_len = 1 if decode else len(r.token_ids)
        handle = self.engine.launch(Batch(self.reqs, decodes=len(self.reqs) if decode else 0))
        for r in self.reqs:
            r.cached_len += r.extend_len
            r.extend_len = 0
            r.num_pending += 1
        return handle

    def _read(self, handle: StepHandle) -> None:
        for r, token in zip(self.reqs, handle.result().tokens, strict=True):
            r.append_token(token)
        if not self.prefilled_at:  # the prompts' step: decoding starts now
            self.prefilled_at = time.perf_counter()
