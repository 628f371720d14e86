"""The reference attention backend: gather pages, then torch's scaled_dot_product_attention.

Runs anywhere torch runs (CPU and CUDA). Keys and values are read from the pool a whole
page at a time: the layer's cache viewed as (pages, page_size, Hkv, D) and indexed by the
block table gives each request's keys in order with one `index_select` (a row copy per
page, not per slot). Requests that add one token this step (decodes) are done together:
their pages are gathered into one padded (B, L) key/value batch with a length mask, every
padded position holding zeros (never unwritten memory). Requests that add several tokens
(prefill chunks) are done one by one, each a causal attention of its new queries over its
cached prefix plus its new keys.

Grouped-query attention: for decodes the G query heads that share a KV head are handed to
SDPA as G query rows of that head, so no KV head is repeated; prefills use SDPA's
`enable_gqa`.

On CUDA it is a real serving path (the one the start-up self-check falls back to from
Triton), not only a reference: the per-step metadata is computed on the host once per step
and sent in pinned, non-blocking copies (utils/staging.py), so the host never waits for
the device, inside a step or between steps, and no layer does host work that depends on
the device. It is not capturable: its decode steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from numpy.lib.stride_tricks import sliding_window_view

from minisgl.utils import split
from minisgl.utils.staging import Staging

from .base import AttentionBackend, ForwardInfo


@dataclass
class _DecodeRows:
    token_idx: torch.Tensor | None  # (Bd,) rows of q that are decodes; None: all (no prefills)
    pages: torch.Tensor  # (Bd, P) int64 page ids; past a request's last page: the scratch page
    tail: torch.Tensor  # positions in the flat (Bd * P * page_size) keys to zero, see below
    bias: torch.Tensor  # (Bd, 1, 1, L) 0 where the position holds a real key, else -inf


@dataclass
class _PrefillRow:
    start: int  # first row of q
    q_len: int
    cached_len: int  # keys before the new tokens, read from the cache
    pages: torch.Tensor | None  # (ceil((cached_len + q_len) / page_size),) None: nothing cached
    mask: torch.Tensor | None  # (q_len, cached_len + q_len) bool, causal; None: nothing cached


@dataclass
class TorchMeta:
    out_slots: torch.Tensor
    decode: _DecodeRows | None
    prefill: list[_PrefillRow]


class TorchBackend(AttentionBackend):
    def __init__(self, pool, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, head_dim)
        self.staging = Staging(pool.k.device)  # the step's metadata, in non-blocking copies
        # a CPU with a second core free: a large decode batch's attention in two halves
        self.two_threads = split.helper_thread_pays(pool.k.device)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        host = self.staging.host(a.size, _TORCH[a.dtype])
        host[:] = a.ravel()
        return self.staging.copy(host).view(a.shape)

    def prepare(self, info: ForwardInfo) -> TorchMeta:
        ext, cached = info.extend_lens_cpu, info.cached_lens_cpu
        device = info.out_slots.device
        if sum(ext) == len(ext):  # one new token each: a pure decode step (the common one)
            lens = np.asarray(cached, dtype=np.int64) + 1  # keys, the new one included
            return TorchMeta(info.out_slots, self._decode_rows(info.block_table, lens), [])
        ps = self.pool.page_size
        decode_req, decode_tok, prefill = [], [], []
        start = 0
        for i, (n, c) in enumerate(zip(ext, cached)):
            if n == 1:
                decode_req.append(i)
                decode_tok.append(start)
            elif c:  # keys before the new ones come from the cache: an explicit causal mask
                pages = info.block_table[i, : -(-(c + n) // ps)].long()
                q_pos = torch.arange(n, device=device)[:, None] + c
                mask = torch.arange(c + n, device=device)[None, :] <= q_pos  # (n, c + n)
                prefill.append(_PrefillRow(start, n, c, pages, mask))
            else:
                prefill.append(_PrefillRow(start, n, c, None, None))
            start += n
        decode = None
        if decode_req:
            lens = np.asarray([cached[i] + 1 for i in decode_req], dtype=np.int64)
            rows = self._to_device(np.asarray(decode_req, dtype=np.int64))
            decode = self._decode_rows(info.block_table.index_select(0, rows), lens)
            decode.token_idx = self._to_device(np.asarray(decode_tok, dtype=np.int64))
        return TorchMeta(info.out_slots, decode, prefill)

    def _decode_rows(self, table: torch.Tensor, lens: np.ndarray) -> _DecodeRows:
        """The decode metadata of requests with `lens` keys each (host arithmetic in numpy:
        at a few hundred requests Python lists and small tensor ops cost more)."""
        ps = self.pool.page_size
        num_pages = -(-lens // ps)
        ends = num_pages * ps  # (B,) the end of each request's last page
        B, P = len(lens), table.shape[1]  # the longest request's pages, or more (padding)
        L = P * ps
        to_device = self._to_device

        # The block table's padding is whatever the engine left there: pages past a
        # request's last one read the zeroed scratch page instead.
        in_use = to_device(np.arange(P) < num_pages[:, None])
        pages = torch.where(in_use, table[:, :P], self.pool.scratch_page).long()
        # A request's last page holds slots past its length that it never wrote: on a GPU
        # they can hold anything, NaN included, and a masked-out key still meets its value in
        # a 0 * value product (0 * NaN = NaN). Those positions (at most page_size - 1 per
        # request) are zeroed after the gather; the scratch page is zero already.
        tail = lens[:, None] + np.arange(ps - 1)  # (B, ps - 1) candidates
        tail = (tail + L * np.arange(B)[:, None])[tail < ends[:, None]]
        # An additive mask, built once per step: SDPA turns a boolean one into this per call.
        bias = to_device(self._bias_rows(lens, L)).to(self.pool.k.dtype).view(B, 1, 1, L)
        return _DecodeRows(None, pages, to_device(tail), bias)

    _bias_half = 0  # M: the source row is [0] * M + [-inf] * M
    _bias_windows: dict[int, np.ndarray] | None = None  # L -> its (M + 1, L) window view

    def _bias_rows(self, lens: np.ndarray, L: int) -> np.ndarray:
        """(B, L) float32: row b is 0 at the first lens[b] positions, -inf after. Each row is
        a window of one [0] * M + [-inf] * M source row (M >= L), copied out in one gather;
        the window views are made once per L (making one costs more than the gather)."""
        if self._bias_half < L:
            M = self._bias_half = max(L, 2 * self._bias_half, 256)
            source = np.concatenate([np.zeros(M, np.float32), np.full(M, -np.inf, np.float32)])
            self._bias_source, self._bias_windows = source, {}
        windows = self._bias_windows.get(L)
        if windows is None:
            windows = self._bias_windows[L] = sliding_window_view(self._bias_source, L)
        return windows[self._bias_half - lens]

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """(..., P) page ids -> (..., P * page_size, Hkv, D) keys (or values), in order."""
        ps = self.pool.page_size
        # (num_pages + 1, page_size * Hkv * D): one flat row per page, which index_select
        # copies about 1.25x faster than the same rows seen as (page_size, Hkv, D) blocks
        by_page = cache.view(-1, ps * cache[0].numel())
        out = by_page.index_select(0, pages.flatten())  # one row copy per page
        return out.view(*pages.shape[:-1], pages.shape[-1] * ps, *cache.shape[1:])

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMeta
    ) -> torch.Tensor:
        self.pool.store(layer_id, meta.out_slots, k, v)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        d = meta.decode
        if d is not None and d.token_idx is None:  # every row of q is a decode
            return self._decode(q, k_cache, v_cache, d)
        out = torch.empty_like(q)
        if d is not None:
            out[d.token_idx] = self._decode(q[d.token_idx], k_cache, v_cache, d)
        for row in meta.prefill:
            rows = slice(row.start, row.start + row.q_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if row.pages is None:  # nothing cached: the new keys are all the keys
                kp, vp = k[rows], v[rows]
                mask, causal = None, True
            else:  # this step's keys were stored above; the page gather reads them back
                S = row.cached_len + row.q_len  # slicing drops the last page's unwritten tail
                kp = self._gather(k_cache, row.pages)[:S]
                vp = self._gather(v_cache, row.pages)[:S]
                mask, causal = row.mask, False
            kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
            vp = vp.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: _DecodeRows
    ) -> torch.Tensor:
        """q: (Bd, H, D), one query per request -> (Bd, H, D)."""
        Bd, H, D = q.shape
        Hkv = k_cache.shape[1]
        k, v = self._gather(k_cache, d.pages), self._gather(v_cache, d.pages)  # (Bd, L, Hkv, D)
        k.view(-1, Hkv, D).index_fill_(0, d.tail, 0.0)
        v.view(-1, Hkv, D).index_fill_(0, d.tail, 0.0)
        # Query head i reads KV head i // G (transformers' repeat_kv order), so the G query
        # heads of a group become G query rows of their KV head: no KV head is repeated.
        qg = q.reshape(Bd, Hkv, H // Hkv, D)
        # (Bd, Hkv, L, D) as strided views: SDPA reads them in place, no transpose copy
        args = (qg, k.transpose(1, 2), v.transpose(1, 2), d.bias)
        # SDPA does about 8x fewer multiply-adds per microsecond than the int4 kernel here
        if self.two_threads and split.worth_splitting(
            Bd, H * k.shape[1] * D, split.SPLIT_WORK // 8
        ):
            o = split.by_rows(_sdpa, *args)
        else:
            o = _sdpa(*args)
        return o.reshape(Bd, H, D)


def _sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}
