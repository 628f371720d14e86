"""DecodeGraphRunner: decode steps replayed from CUDA graphs, one per batch-size bucket.

Why: a decode step of a small model is well under a millisecond of GPU work but hundreds of
kernel launches; launched from Python one by one, the host is the bottleneck. A CUDA graph
records the launches of one step once and replays them with a single call.

Contract: every tensor the captured step reads lives in static buffers sized for the
largest bucket (token ids, positions, KV write slots, block table, sequence lengths), and
the step's logits land in a static buffer too. `run(batch)` copies a decode batch into the
buffers, pads it to the next bucket with dummy rows (token 0 at position 0, writing its K/V
to the pool's scratch page, reading a one-token sequence from it), replays the bucket's
graph and returns the real rows' logits. Without capture (CPU, or --disable-cuda-graph with
the triton backend) the same buffers run eagerly, which is how the padding is tested
without a GPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minisgl.attention.triton_backend import MAX_SPLITS, DecodeMeta, TritonBackend
from minisgl.core import Batch

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)

BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]


class DecodeGraphRunner:
    def __init__(self, engine: Engine, max_batch_size: int, capture: bool) -> None:
        assert isinstance(engine.attn_backend, TritonBackend)
        self.engine = engine
        self.backend: TritonBackend = engine.attn_backend
        self.buckets = [b for b in BUCKETS if b < max_batch_size] + [max_batch_size]
        self.max_bs = max_batch_size
        dev, c = engine.device, engine.model_config
        pool = engine.pool
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_slots = torch.full(
            (self.max_bs,), pool.scratch_slot, dtype=torch.int64, device=dev
        )
        self.block_table = torch.full(
            (self.max_bs, engine.max_pages_per_req),
            pool.scratch_page,
            dtype=torch.int32,
            device=dev,
        )
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.part_out, self.part_lse = self.backend.scratch(self.max_bs, MAX_SPLITS)
        self.logits = torch.zeros(self.max_bs, c.vocab_size, dtype=torch.float32, device=dev)
        # host staging rows, padded once: a dummy row reads and writes only the scratch page
        self._host_slots = torch.full((self.max_bs,), pool.scratch_slot, dtype=torch.int64)
        self._host_table = torch.full(
            (self.max_bs, engine.max_pages_per_req), pool.scratch_page, dtype=torch.int32
        )
        self._staged = 0  # host rows holding real requests from the previous step
        self.steps = 0  # decode steps run through the static buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def can_run(self, batch: Batch) -> bool:
        """One new token per request, each of which samples (a recomputed prompt's
        one-token chunk does not), and not more requests than the largest bucket."""
        return (
            len(batch.reqs) <= self.max_bs
            and batch.is_decode
            and all(r.samples_this_step for r in batch.reqs)
        )

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # --8<-- [start:graph_forward]
    def _forward(self, bs: int) -> None:
        """One decode step over the first `bs` rows of the static buffers."""
        from .engine import _StepContext

        meta = DecodeMeta(
            self.out_slots[:bs],
            self.block_table[:bs],
            self.seq_lens[:bs],
            self.backend.num_splits(bs),
            self.part_out[:bs],
            self.part_lse[:bs],
        )
        ctx = _StepContext(self.backend, meta)
        hidden = self.engine.model(self.input_ids[:bs], self.positions[:bs], ctx)
        self.logits[:bs] = self.engine.model.logits(hidden)

    # --8<-- [end:graph_forward]

    def _capture_all(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        for bs in reversed(self.buckets):  # largest first: the others reuse its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the Triton kernels, warm the allocator
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def run(self, batch: Batch) -> torch.Tensor:
        """(B, vocab) logits of a decode batch of B <= max_batch_size requests."""
        reqs = batch.reqs
        B, bs = len(reqs), self._bucket(len(reqs))
        ps = self.engine.page_size
        page_table = self.engine.page_table
        pool = self.engine.pool
        self._host_slots[: self._staged] = pool.scratch_slot  # back to dummy rows
        self._host_table[: self._staged] = pool.scratch_page
        rows = torch.tensor([r.table_idx for r in reqs])
        pos = torch.tensor([r.cached_len for r in reqs])
        self._host_slots[:B] = page_table[rows, pos // ps].long() * ps + pos % ps
        self._host_table[:B] = page_table[rows]
        tokens = torch.tensor([r.token_ids[r.cached_len] for r in reqs])
        # rows past B keep the dummy values they were padded with
        self.input_ids[:B].copy_(tokens, non_blocking=True)
        self.input_ids[B:bs].zero_()
        self.positions[:B].copy_(pos, non_blocking=True)
        self.positions[B:bs].zero_()
        self.seq_lens[:B].copy_(pos + 1, non_blocking=True)
        self.seq_lens[B:bs].fill_(1)
        self.out_slots[:bs].copy_(self._host_slots[:bs], non_blocking=True)
        self.block_table[:bs].copy_(self._host_table[:bs], non_blocking=True)
        self._staged = B
        self.steps += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.logits[:B]
