"""The attention backend interface.

Contract: once per step the engine builds a `ForwardInfo` (where every token of the step
sits: its request, its position, the cache slot its K/V goes to, each request's pages) and
calls `backend.prepare(info)`. Then, for every layer, the model calls
`backend.attention(layer_id, q, k, v, meta)`, which stores the step's K/V into the pool and
returns the attention output (T, H, D) over each request's cached prefix plus its new
tokens, causally. Backends own no request state; they may keep buffers keyed by shape.

A backend whose decode step can be recorded as a CUDA graph says so (`capturable`) and
implements three hooks, which are all a graph runner (engine/graph.py) knows of it:
`init_capture(max_bs)` allocates the fixed buffers its metadata needs, then per batch size
`prepare_for_capture(info)` builds metadata over fixed buffers (`info`'s tensors are fixed
too) and before each replay `prepare_for_replay(info, meta)` refreshes whatever of that
metadata is not already in `info`'s buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kvcache import KVCachePool


@dataclass
class ForwardInfo:
    """Per-step layout, on the device unless noted. B = requests, T = tokens, P = pages."""

    positions: torch.Tensor  # (T,) int64: position of each token in its sequence
    out_slots: torch.Tensor  # (T,) int64: cache slot each token's K/V is written to
    block_table: torch.Tensor  # (B, P) int32: page ids of each request, padded
    seq_lens: torch.Tensor  # (B,) int32: KV length of each request after this step
    extend_lens_cpu: list[int]  # host: new tokens per request
    cached_lens_cpu: list[int]  # host: tokens already cached per request

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)


class AttentionBackend(ABC):
    capturable = False  # whether decode steps can be recorded as CUDA graphs

    def __init__(self, pool: KVCachePool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, info: ForwardInfo) -> Any:
        """Build whatever per-step metadata `attention` needs; called once per step."""

    @abstractmethod
    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """q: (T, H, D), k/v: (T, Hkv, D) -> (T, H, D)."""

    # --8<-- [start:capture_hooks]
    def init_capture(self, max_batch_size: int) -> None:
        """Allocate the fixed buffers decode metadata of up to `max_batch_size` rows needs."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured")

    def prepare_for_capture(self, info: ForwardInfo) -> Any:
        """Metadata of a decode step over fixed buffers, to be recorded in a graph."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured")

    def prepare_for_replay(self, info: ForwardInfo, meta: Any) -> None:  # noqa: B027 (optional)
        """Refresh `meta` for the real step about to be replayed (nothing by default: the
        step's layout is already in `info`'s fixed buffers)."""

    # --8<-- [end:capture_hooks]


class AttentionContext:
    """What the model's layers call for attention during one step: a backend and the
    step's metadata."""

    __slots__ = ("backend", "meta")

    def __init__(self, backend: AttentionBackend, meta: Any) -> None:
        self.backend, self.meta = backend, meta

    def attention(self, layer_id: int, q, k, v) -> torch.Tensor:
        return self.backend.attention(layer_id, q, k, v, self.meta)
