"""The attention backend interface.

Contract: once per step the engine builds a `ForwardInfo` (where every token of the step
sits: its request, its position, the cache slot its K/V goes to, each request's pages) and
calls `backend.prepare(info)`. Then, for every layer, the model calls
`backend.attention(layer_id, q, k, v, meta)`, which stores the step's K/V into the pool and
returns the attention output (T, H, D) over each request's cached prefix plus its new
tokens, causally. Backends own no request state; they may keep buffers keyed by shape.
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
    graphable = False  # whether decode steps can be captured as CUDA graphs

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


def create_attention_backend(
    name: str, pool: KVCachePool, num_heads: int, head_dim: int, device: torch.device
) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(pool, num_heads, head_dim)
    if name == "triton":
        from .triton_backend import TritonBackend

        return TritonBackend(pool, num_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")


def _triton_available() -> bool:
    try:
        from . import triton_backend  # noqa: F401
    except ImportError:
        return False
    return True
