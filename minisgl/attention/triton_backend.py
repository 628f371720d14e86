"""The Triton attention backend: paged kernels for CUDA (triton_kernels.py).

Contract: same interface as every backend (base.py). A step whose requests all add one
token runs the split-KV decode kernel; any other step runs the varlen prefill kernel for
all of its tokens (decode rows in a mixed step are prefill rows of length one). The K/V of
the step are written by one store kernel before attention reads the cache.

The backend is capturable: a decode step's metadata is the step's fixed input buffers
(write slots, block table, lengths) plus split-KV scratch allocated once by
`init_capture`, so a CUDA graph replays with whatever the input builder last wrote there.

One compiled prefill kernel serves every step: Triton compiles a kernel anew for each
combination of its arguments' "specializations" (an integer equal to 1 or divisible by 16,
a pointer aligned to 16 bytes), and would otherwise meet new ones mid-serving, each a
compilation of up to a second inside a step. So the step's metadata arrays are laid out at
16-byte boundaries, and the block table's row stride (the longest request's page count)
is not specialized on; the start-up self-check's prefill step compiles that one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.utils.staging import Staging

from . import triton_kernels as tk
from .base import AttentionBackend, ForwardInfo

PREFILL_BLOCK_M = 64
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256
ALIGN_INT32 = 4  # int32s in 16 bytes: the alignment Triton specializes a pointer on


def num_splits_for(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough (request, KV head, split) programs to fill the GPU about twice, but no split
    shorter than MIN_TOKENS_PER_SPLIT tokens of the longest possible sequence."""
    want = -(-2 * num_sms // max(1, batch_size * num_kv_heads))
    cap = max(1, -(-max_seq_len // MIN_TOKENS_PER_SPLIT))
    return max(1, min(want, cap, MAX_SPLITS))


@dataclass
class DecodeMeta:
    out_slots: torch.Tensor  # (B,)
    block_table: torch.Tensor  # (B, P) int32
    seq_lens: torch.Tensor  # (B,) int32
    num_splits: int
    part_out: torch.Tensor  # (B, H, S, D) float32 scratch
    part_lse: torch.Tensor  # (B, H, S) float32 scratch


@dataclass
class PrefillMeta:
    out_slots: torch.Tensor
    block_table: torch.Tensor
    q_start: torch.Tensor  # (B,) int32: first row of each request's queries
    ext_lens: torch.Tensor  # (B,) int32
    cached_lens: torch.Tensor  # (B,) int32
    blk_req: torch.Tensor  # (NB,) int32: request of each query block
    blk_m0: torch.Tensor  # (NB,) int32: first query of each block within its request


class TritonBackend(AttentionBackend):
    capturable = True  # decode metadata can live in fixed buffers (engine/graph.py)

    def __init__(self, pool, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, head_dim)
        device = pool.k.device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 8
        )
        self.max_seq_len = pool.num_pages * pool.page_size
        self._graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.staging = Staging(device)  # a prefill step's block lists, one copy

    def num_splits(self, batch_size: int) -> int:
        return num_splits_for(batch_size, self.pool.k.shape[2], self.max_seq_len, self.num_sms)

    def scratch(self, batch_size: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.pool.k.device
        part_out = torch.empty(
            batch_size,
            self.num_heads,
            num_splits,
            self.head_dim,
            dtype=torch.float32,
            device=device,
        )
        part_lse = torch.empty(
            batch_size, self.num_heads, num_splits, dtype=torch.float32, device=device
        )
        return part_out, part_lse

    def init_capture(self, max_batch_size: int) -> None:
        self._graph_scratch = self.scratch(max_batch_size, MAX_SPLITS)

    def prepare_for_capture(self, info: ForwardInfo) -> DecodeMeta:
        assert self._graph_scratch is not None, "init_capture first"
        B = len(info.extend_lens_cpu)
        part_out, part_lse = self._graph_scratch
        return DecodeMeta(
            info.out_slots, info.block_table, info.seq_lens, self.num_splits(B),
            part_out[:B], part_lse[:B],
        )  # fmt: skip

    def prepare(self, info: ForwardInfo) -> DecodeMeta | PrefillMeta:
        if info.is_decode:
            B = len(info.extend_lens_cpu)
            splits = self.num_splits(B)
            return DecodeMeta(
                info.out_slots, info.block_table, info.seq_lens, splits, *self.scratch(B, splits)
            )
        ext = info.extend_lens_cpu
        starts, pos = [], 0
        for n in ext:
            starts.append(pos)
            pos += n
        blk_req, blk_m0 = tk.prefill_blocks(ext, PREFILL_BLOCK_M)
        parts = [starts, ext, info.cached_lens_cpu, blk_req, blk_m0]
        # each part padded to 16 bytes: every pointer the kernel gets is as aligned in every
        # step, so one compiled kernel serves them all (triton_kernels.py, `_prefill_kernel`)
        padded = [len(part) + -len(part) % ALIGN_INT32 for part in parts]
        flat = self.staging.to_device(
            [x for part, n in zip(parts, padded) for x in part + [0] * (n - len(part))],
            torch.int32,
        )
        metas = [m[: len(part)] for m, part in zip(flat.split(padded), parts)]
        return PrefillMeta(info.out_slots, info.block_table, *metas)

    def attention(self, layer_id, q, k, v, meta):
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        tk.store_kv(k, v, k_cache, v_cache, meta.out_slots)
        ps = self.pool.page_size
        if isinstance(meta, DecodeMeta):
            out = torch.empty_like(q)
            return tk.decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, ps, self.scale,
                meta.num_splits, meta.part_out, meta.part_lse, out,
            )  # fmt: skip
        return tk.prefill_attention(
            q, k_cache, v_cache, meta.block_table, meta.q_start, meta.ext_lens,
            meta.cached_lens, meta.blk_req, meta.blk_m0, ps, self.scale, PREFILL_BLOCK_M,
        )  # fmt: skip
