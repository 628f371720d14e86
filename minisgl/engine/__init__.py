"""The engine: model + KV cache + one forward step (no requests, no messages)."""

from __future__ import annotations

from .config import EngineConfig
from .engine import Engine

__all__ = ["Engine", "EngineConfig"]
