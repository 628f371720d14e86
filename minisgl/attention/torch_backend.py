"""The reference attention backend: gather pages, then torch's scaled_dot_product_attention.

Runs anywhere torch runs (CPU and CUDA). Requests that add one token this step (decodes)
are done together: their pages are gathered into one padded (B, L) key/value batch with a
length mask. Requests that add several tokens (prefill chunks) are done one by one, each a
causal attention of its new queries over its cached prefix plus its new keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend, ForwardInfo


@dataclass
class _DecodeRows:
    token_idx: torch.Tensor  # (Bd,) rows of q that are single-token requests
    kv_slots: torch.Tensor  # (Bd, L) cache slot of every key position, padded
    mask: torch.Tensor  # (Bd, 1, 1, L) True where the position holds a real key


@dataclass
class _PrefillRow:
    start: int  # first row of q
    q_len: int
    cached_len: int  # keys before the new tokens, read from the cache
    kv_slots: torch.Tensor | None  # (cached_len + q_len,) slots, None when nothing is cached


@dataclass
class TorchMeta:
    out_slots: torch.Tensor
    decode: _DecodeRows | None
    prefill: list[_PrefillRow]


class TorchBackend(AttentionBackend):
    def prepare(self, info: ForwardInfo) -> TorchMeta:
        page_size = self.pool.page_size
        device = info.out_slots.device
        in_page = torch.arange(page_size, device=device)
        # (B, P * page_size) slot of every position of every request
        all_slots = (info.block_table.long()[:, :, None] * page_size + in_page).flatten(1)

        decode_req, decode_tok, prefill = [], [], []
        start = 0
        for i, (n, cached) in enumerate(zip(info.extend_lens_cpu, info.cached_lens_cpu)):
            if n == 1:
                decode_req.append(i)
                decode_tok.append(start)
            else:
                slots = all_slots[i, : cached + n] if cached > 0 else None
                prefill.append(_PrefillRow(start, n, cached, slots))
            start += n

        decode = None
        if decode_req:
            rows = torch.tensor(decode_req, device=device)
            seq_lens = info.seq_lens[rows].long()
            L = int(max(c + 1 for c in (info.cached_lens_cpu[i] for i in decode_req)))
            mask = torch.arange(L, device=device)[None, :] < seq_lens[:, None]
            # padded positions read the zeroed scratch page: never uninitialised memory,
            # which could hold NaN and poison the masked-out products
            kv_slots = torch.where(mask, all_slots[rows, :L], self.pool.scratch_slot)
            decode = _DecodeRows(
                torch.tensor(decode_tok, device=device), kv_slots, mask[:, None, None, :]
            )
        return TorchMeta(info.out_slots, decode, prefill)

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchMeta
    ) -> torch.Tensor:
        self.pool.store(layer_id, meta.out_slots, k, v)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        out = torch.empty_like(q)
        if (d := meta.decode) is not None:
            qd = q[d.token_idx].unsqueeze(2)  # (Bd, H, 1, D)
            kd = k_cache[d.kv_slots].transpose(1, 2)  # (Bd, Hkv, L, D)
            vd = v_cache[d.kv_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, enable_gqa=True)
            out[d.token_idx] = o.squeeze(2)
        for row in meta.prefill:
            rows = slice(row.start, row.start + row.q_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if row.kv_slots is None:  # nothing cached: the new keys are all the keys
                kp, vp = k[rows], v[rows]
                mask, causal = None, True
            else:
                kp, vp = k_cache[row.kv_slots], v_cache[row.kv_slots]
                q_pos = torch.arange(row.q_len, device=q.device)[:, None] + row.cached_len
                kv_pos = torch.arange(kp.shape[0], device=q.device)[None, :]
                mask, causal = kv_pos <= q_pos, False  # (n, cached + n)
            kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
            vp = vp.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out
