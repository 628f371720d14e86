"""Models in plain torch with Hugging Face config and weight names."""

from __future__ import annotations

from .config import ModelConfig
from .decoder import CausalLM

__all__ = ["CausalLM", "ModelConfig"]
