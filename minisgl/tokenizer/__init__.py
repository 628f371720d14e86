"""Tokenization (prompt -> ids) and incremental detokenization (ids -> text)."""

from __future__ import annotations

from .detokenize import DetokenizeManager
from .tokenize import build_prompt_ids, load_tokenizer

__all__ = ["DetokenizeManager", "build_prompt_ids", "load_tokenizer"]
