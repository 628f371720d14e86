"""StepInputBuilder: the one producer of a forward step's inputs, for eager steps and graphs.

Contract: `build(batch, pad_to=None)` turns the requests of a step (each with its
`table_idx`, `cached_len`, `extend_len`) into `StepInputs` on the device: token ids,
positions, the cache slot each token's K/V goes to, each request's row of page ids and its
sequence length, and which rows sample. With `pad_to=bs` (decode steps only) the inputs
land in fixed buffers of `bs` rows that a captured CUDA graph reads (`decode_buffers`), the
rows past the real ones padded as dummy requests.

How it stays cheap on the host:
- The builder owns the device page table (one row of page ids per request slot, plus a
  last row of scratch pages that dummy rows point at). The scheduler's cache manager
  records the entries of requests whose pages changed and hands them over once per step;
  `write_pages(edits)` writes them in one copy (from a `Staging` ring of its own) and one
  scatter on the device. A step only reads the table, on the device.
- Per step the host writes a few small integer arrays (ids, positions, slots) into one
  buffer from a `Staging` ring (pinned on CUDA, so the copy never waits for the step the
  device is still running) and copies it to the device once, `non_blocking`. Everything
  else (write slots, sequence lengths, page rows) is derived on the device.
- A token sampled by the previous step may not have reached the host yet (its request has
  `num_pending`): its id is written as -1 and read on the device from `last_tokens`, where
  every step leaves the tokens it sampled, by request slot (`record_sampled`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.attention import ForwardInfo
from minisgl.core import Batch
from minisgl.utils.staging import Staging


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    info: ForwardInfo
    sample_rows: torch.Tensor | None  # (S,) rows of the hidden states that sample; None:
    # the first num_reqs rows (every request samples), or, in a prefill step, none (the
    # engine then runs no LM head)
    sample_slots: torch.Tensor  # (S,) request slot of each sampling row (for last_tokens)
    num_reqs: int  # real requests (rows past them are padding)


@dataclass
class DecodeBuffers:
    """Fixed device buffers of `max_bs` decode rows: a CUDA graph captured over their first
    `bs` rows reads whatever the builder last wrote there."""

    input_ids: torch.Tensor  # (max_bs,) int64
    positions: torch.Tensor  # (max_bs,) int64
    out_slots: torch.Tensor  # (max_bs,) int64
    seq_lens: torch.Tensor  # (max_bs,) int32
    block_table: torch.Tensor  # (max_bs, max_pages) int32

    def info(self, bs: int) -> ForwardInfo:
        """The layout of a `bs`-row decode step over these buffers."""
        return ForwardInfo(
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            block_table=self.block_table[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens_cpu=[1] * bs,
            cached_lens_cpu=[0] * bs,  # not read by a capturable backend's decode
        )


class StepInputBuilder:
    def __init__(
        self,
        max_reqs: int,
        max_pages_per_req: int,
        page_size: int,
        scratch_page: int,
        device: torch.device,
        max_graph_bs: int = 0,
    ) -> None:
        self.page_size = page_size
        self.device = device
        self.dummy_slot = max_reqs  # the page table's last row: scratch pages only
        # --8<-- [start:page_table]
        self.page_table = torch.full(
            (max_reqs + 1, max_pages_per_req), scratch_page, dtype=torch.int32, device=device
        )
        self.last_tokens = torch.zeros(max_reqs + 1, dtype=torch.int64, device=device)
        # --8<-- [end:page_table]
        self.staging = Staging(device)
        self._page_staging = Staging(device)  # the page-table edits' copies
        self.decode_buffers: DecodeBuffers | None = None
        if max_graph_bs:
            self.decode_buffers = DecodeBuffers(
                input_ids=torch.zeros(max_graph_bs, dtype=torch.int64, device=device),
                positions=torch.zeros(max_graph_bs, dtype=torch.int64, device=device),
                out_slots=torch.zeros(max_graph_bs, dtype=torch.int64, device=device),
                seq_lens=torch.ones(max_graph_bs, dtype=torch.int32, device=device),
                block_table=torch.full(
                    (max_graph_bs, max_pages_per_req),
                    scratch_page,
                    dtype=torch.int32,
                    device=device,
                ),
            )

    # --8<-- [start:flush]
    def write_pages(self, edits: list[int]) -> None:
        """Write page-table entries, flat (row, column, page) triples (the cache manager's
        `take_edits()`), into the page table: one copy to the device."""
        if not edits:
            return
        entries = self._page_staging.to_device(edits, torch.int32).view(-1, 3)
        rows, cols = entries[:, 0].long(), entries[:, 1].long()
        self.page_table.index_put_((rows, cols), entries[:, 2])

    # --8<-- [end:flush]

    # --8<-- [start:build]
    def build(self, batch: Batch, pad_to: int | None = None) -> StepInputs:
        reqs, B = batch.reqs, len(batch.reqs)
        rows = pad_to or B  # padding rows are dummy decodes: token 0 at position 0
        is_decode = batch.is_decode
        assert pad_to is None or (is_decode and pad_to >= B), "only decode steps are padded"
        cached = [r.cached_len for r in reqs]
        ext = [1] * B if is_decode else [r.extend_len for r in reqs]
        T = rows if is_decode else sum(ext)
        sampling = batch.sampling_rows
        # S = 0: every row is a request that samples (a decode step)
        S = 0 if is_decode and len(sampling) == B else len(sampling)

        # host: [ids T | positions T | each position's page column T and offset in the page
        # T | slots rows | seq_lens rows | sample rows S | their requests S | token's request
        # T (prefill steps)], one staging buffer
        sizes = [T, T, T, T, rows, rows, S, S, 0 if is_decode else T]
        host = self.staging.host(sum(sizes), torch.int64)
        ids, pos, page_col, page_off, slots, seq, s_rows, s_reqs, tok_req = _split(host, sizes)
        slots[:B] = [r.table_idx for r in reqs]
        slots[B:] = self.dummy_slot
        # (builtins on lists here, not numpy's methods: in a step, between torch ops, each
        # numpy method call measured tens of microseconds, several times its cost alone)
        if is_decode:
            tokens = [-1 if r.num_pending else r.token_ids[r.cached_len] for r in reqs]
            pending = -1 in tokens  # rows whose token is still on the device
            ids[:B] = tokens
            ids[B:] = 0
            pos[:B] = cached
            pos[B:] = 0
            seq[:B] = pos[:B] + 1
            seq[B:] = 1
            longest = max(cached, default=0) + 1
            if S:  # one-token prefill chunks look like decodes: some of them do not sample
                s_rows[:] = sampling
        else:
            pending = False
            ext_np, cached_np = np.array(ext), np.array(cached)
            starts = np.cumsum(ext_np) - ext_np
            for r, k, off in zip(reqs, ext, starts.tolist()):
                if r.num_pending:  # only a decode row can wait for its token
                    ids[off] = -1
                    pending = True
                else:
                    ids[off : off + k] = r.token_ids[r.cached_len : r.cached_len + k]
            tok_req[:] = np.repeat(np.arange(B), ext_np)
            pos[:] = np.arange(T) + (cached_np - starts)[tok_req]
            seq[:] = cached_np + ext_np
            longest = max(c + k for c, k in zip(cached, ext))
            if S:
                s_rows[:] = (starts + ext_np - 1)[sampling]
        if S:
            s_reqs[:] = sampling
        ps = self.page_size
        np.floor_divide(pos, ps, out=page_col)
        np.remainder(pos, ps, out=page_off)

        # one copy to the device; everything else is derived there
        dev = self.staging.copy(host)
        parts = torch.split(dev, sizes)
        input_ids, positions, page_col, page_off, req_slots, seq_lens = parts[:6]
        sample_rows, sample_reqs, tok_req_d = parts[6:]
        tok_slots = req_slots if is_decode else req_slots[tok_req_d]
        if pending:
            input_ids = torch.where(input_ids < 0, self.last_tokens[tok_slots], input_ids)
        # the cache slot of each token: its page (from the page table) * page_size + offset
        out_slots = torch.add(page_off, self.page_table[tok_slots, page_col], alpha=ps)
        seq_lens = seq_lens.to(torch.int32)
        sample_slots = req_slots[sample_reqs] if S else req_slots[:B]

        if pad_to is not None:  # into the fixed buffers a captured graph reads
            buf = self.decode_buffers
            assert buf is not None, "this builder has no decode buffers"
            buf.input_ids[:rows].copy_(input_ids)
            buf.positions[:rows].copy_(positions)
            buf.out_slots[:rows].copy_(out_slots)
            buf.seq_lens[:rows].copy_(seq_lens)
            torch.index_select(self.page_table, 0, req_slots, out=buf.block_table[:rows])
            info, input_ids = buf.info(rows), buf.input_ids[:rows]
        else:
            P = -(-longest // ps) if B else 0
            info = ForwardInfo(
                positions=positions,
                out_slots=out_slots,
                block_table=self.page_table[req_slots, :P],
                seq_lens=seq_lens,
                extend_lens_cpu=ext,
                cached_lens_cpu=cached,
            )
        return StepInputs(input_ids, info, sample_rows if S else None, sample_slots, B)

    # --8<-- [end:build]

    def record_sampled(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Leave the step's sampled tokens where the next step's pending rows read them."""
        self.last_tokens.index_copy_(0, inputs.sample_slots, tokens)


def _split(buffer: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Consecutive views of `buffer` of the given sizes (np.split, without its overhead)."""
    views, start = [], 0
    for size in sizes:
        views.append(buffer[start : start + size])
        start += size
    return views
