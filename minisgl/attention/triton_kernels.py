"""Triton kernels for paged attention: the KV write, prefill and split-KV decode.

Layouts (see kvcache/pool.py): one layer's cache is (slots, Hkv, D) with slot =
page * PAGE_SIZE + offset; `block_table` is (B, P) int32 page ids per request.

- `store_kv`: writes the step's K and V rows (T, Hkv, D) into their slots, one launch.
- `prefill_attention`: varlen causal attention of each request's new queries over its
  cached prefix plus its new keys (already stored), one program per (query block, head).
- `decode_attention`: one query token per request. The key range of a request is split
  into NUM_SPLITS pieces processed in parallel; each program takes all G query heads of
  one KV head together (one (G, D) x (D, BLOCK_N) product), so every KV page is read once
  per split rather than once per query head. A second small kernel merges the splits by
  their log-sum-exp.
All kernels run under TRITON_INTERPRET=1 on a CPU for the correctness tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ---------------------------------------------------------------------------- KV write
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_k, stride_v, stride_cache,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cache + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cache + offs, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: (T, Hkv, D), rows may be strided; caches: (S, Hkv, D) contiguous; slots: (T,)."""
    T = k.shape[0]
    if T == 0:
        return
    row = k.shape[1] * k.shape[2]
    assert k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), v.stride(0), k_cache.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )  # fmt: skip


# ---------------------------------------------------------------------------- one KV block
@triton.jit
def _attend_block(
    q, m_i, l_i, acc, q_pos,
    k_cache_ptr, v_cache_ptr, table_row_ptr, n0, kv_end, kvh, offs_d, mask_d,
    stride_cs, stride_ch, scale,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [n0, n0 + BLOCK_N) of one request's paged cache: returns the
    updated running max, sum and (rows, D) accumulator. Shared by prefill and decode."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    page = tl.load(table_row_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_off = slot[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # (rows, BLOCK_N)
    allowed = mask_n[None, :]
    if CAUSAL:
        allowed = allowed & (q_pos[:, None] >= offs_n[None, :])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------- prefill
# stride_bt is the step's longest request's page count: specialized on (== 1, % 16), each
# value class would compile another kernel in the middle of serving
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, q_start_ptr, ext_len_ptr, cached_len_ptr,
    blk_req_ptr, blk_m0_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_bt,
    scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    r = tl.load(blk_req_ptr + blk)
    m0 = tl.load(blk_m0_ptr + blk)
    q_start = tl.load(q_start_ptr + r)
    ext = tl.load(ext_len_ptr + r)
    cached = tl.load(cached_len_ptr + r)

    offs_m = m0 + tl.arange(0, BLOCK_M)  # query index within the request's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = cached + offs_m  # absolute positions of the queries

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = cached + tl.minimum(m0 + BLOCK_M, ext)  # causal: no key past the last query
    for n0 in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, q_pos,
            k_cache_ptr, v_cache_ptr, block_table_ptr + r * stride_bt, n0, kv_end, kvh,
            offs_d, mask_d, stride_cs, stride_ch, scale,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=True,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_blocks(ext_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """Host-side work list: (request, first query) of every BLOCK_M-row block."""
    reqs, starts = [], []
    for r, n in enumerate(ext_lens):
        for m0 in range(0, n, block_m):
            reqs.append(r)
            starts.append(m0)
    return reqs, starts


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_start: torch.Tensor,
    ext_lens: torch.Tensor,
    cached_lens: torch.Tensor,
    blk_req: torch.Tensor,
    blk_m0: torch.Tensor,
    page_size: int,
    scale: float,
    block_m: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, H, D) -> (T, H, D); K/V of every token must already be in the cache."""
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    grid = (blk_req.shape[0], H)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        block_table, q_start, ext_lens, cached_lens, blk_req, blk_m0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        scale,
        GROUP=H // Hkv, HEAD_DIM=D, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=max(16, triton.next_power_of_2(D)),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- decode
@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_splits, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )  # (BLOCK_G, BLOCK_D): the query heads that share this KV head

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, offs_g,  # no causal mask: the positions go unused
            k_cache_ptr, v_cache_ptr, block_table_ptr + b * stride_bt, n0, end, kvh,
            offs_d, mask_d, stride_cs, stride_ch, scale,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False,
        )  # fmt: skip

    empty = l_i == 0.0  # a split past the end of a short sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        part_out_ptr
        + b * stride_pb
        + heads[:, None] * stride_ph
        + split * stride_ps
        + offs_d[None, :],
        out,
        mask=mask_g[:, None] & mask_d[None, :],
    )
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    w = tl.where(mask_s, tl.exp(lse - m), 0.0)  # split weights; empty splits weigh 0
    parts = tl.load(
        part_out_ptr
        + b * stride_pb
        + h * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    num_splits: int,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """q: (B, H, D), one token per request -> out (B, H, D). part_out (B, H, S, D) float32
    and part_lse (B, H, S) float32 are scratch buffers with S >= num_splits."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    group = H // Hkv
    block_d = max(16, triton.next_power_of_2(D))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        num_splits, scale,
        GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=32, BLOCK_D=block_d,
    )  # fmt: skip
    _decode_merge_kernel[(B, H)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(part_out.shape[2])), BLOCK_D=block_d,
    )  # fmt: skip
    return out
