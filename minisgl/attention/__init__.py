"""Attention backends behind one interface (see base.py)."""

from __future__ import annotations

from .base import AttentionBackend, AttentionContext, ForwardInfo, create_attention_backend

__all__ = ["AttentionBackend", "AttentionContext", "ForwardInfo", "create_attention_backend"]
