"""KVCachePool: the device memory that holds every layer's keys and values.

Layout per layer: (num_pages * page_size, Hkv, D), indexed by a flat *slot*
`page * page_size + offset`. One extra page past the end is a scratch page that padded
(dummy) batch rows may write to and padded key positions may read from; no request owns it.

Only the scratch page is zeroed. The rest is left uninitialised, so on a CPU the operating
system commits memory only as pages are first written; no backend lets an unwritten slot's
value reach a result (the torch backend gathers whole pages and zeroes the unwritten tail
of a request's last page).
"""

from __future__ import annotations

import torch


class KVCachePool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_page = num_pages
        slots = (num_pages + 1) * page_size
        shape = (num_layers, slots, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        scratch = slice(num_pages * page_size, slots)
        self.k[:, scratch].zero_()
        self.v[:, scratch].zero_()
        self.scratch_slot = num_pages * page_size

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: (T,), k/v: (T, Hkv, D)
        self.k[layer_id].index_copy_(0, slots, k)
        self.v[layer_id].index_copy_(0, slots, v)
