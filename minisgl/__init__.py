"""minisgl: a teaching-oriented but real LLM inference server.

Offline use: `from minisgl import LLM, SamplingParams`. `LLM` is imported on first use,
so that the API server process, which never runs the model, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core import SamplingParams

if TYPE_CHECKING:
    from .llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
