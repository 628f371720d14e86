"""Attention backends behind one interface (base.py), and the factory that picks one.

Contract: `create_attention_backend(name, pool, num_heads, head_dim, device)` returns the
backend called `name` (`torch`, `triton`, or `auto`: triton on CUDA when Triton imports,
torch otherwise) over `pool`; any other name is a `ValueError`. The factory lives here, not
in base.py, so the backends import the interface and nothing imports back in a circle.
"""

from __future__ import annotations

import torch

from minisgl.kvcache import KVCachePool

from .base import AttentionBackend, AttentionContext, ForwardInfo

__all__ = ["AttentionBackend", "AttentionContext", "ForwardInfo", "create_attention_backend"]


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
