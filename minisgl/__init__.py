"""minisgl: a teaching-oriented but real LLM inference server.

Offline use: `from minisgl import LLM, SamplingParams`.
"""

from __future__ import annotations

from .core import SamplingParams
from .llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
