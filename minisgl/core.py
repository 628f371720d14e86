"""Core data of the engine: sampling parameters, one request's state, one forward batch.

Contract:
- `SamplingParams` is what a user may ask for per request; it travels inside messages.
- `Req` is the scheduler's record of one admitted request. It owns the request's token ids
  (prompt followed by outputs) and knows how far the KV cache has caught up (`cached_len`).
  It never touches devices: pages and table slots are handed to it by the managers.
- `Batch` is one forward step: the requests in it and how many new tokens each contributes.

A request advances like this (T = len(token_ids)):
    prefill chunk:  tokens [cached_len, cached_len + extend_len) run through the model
    after the step: cached_len += extend_len; if cached_len == T the step produced a
                    sampled token, appended to token_ids (T grows by one)
    decode:         extend_len == 1, the one token not yet in the cache
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0
    max_tokens: int | None = None  # None: as many as the context allows
    ignore_eos: bool = False
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> tuple[str, str] | None:
        """Return (parameter, message) for a value no request may carry, else None."""
        if self.max_tokens is not None and self.max_tokens < 1:
            return "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
        if not self.temperature >= 0.0:  # also catches NaN
            return "temperature", f"temperature must be non-negative, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p", f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k == 0 or self.top_k < -1:
            return "top_k", f"top_k must be -1 (disabled) or at least 1, got {self.top_k}"
        return None


@dataclass(eq=False)
class Req:
    """One admitted request as the scheduler sees it."""

    uid: int
    token_ids: list[int]  # prompt followed by every sampled token
    prompt_len: int
    max_len: int  # prompt_len + max_tokens after clamping to the context
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    table_idx: int = -1  # slot in the page table; -1 while it holds none
    cached_len: int = 0  # tokens whose K/V are in the cache
    extend_len: int = 0  # tokens this step feeds to the model (set by the managers)
    pages: list[int] = field(default_factory=list)  # KV pages owned, in order
    finish_reason: FinishReason | None = None

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def uncached_len(self) -> int:
        return len(self.token_ids) - self.cached_len

    @property
    def samples_this_step(self) -> bool:
        """Whether this step's last token is the end of what is known, so a token is sampled."""
        return self.cached_len + self.extend_len == len(self.token_ids)

    def append_token(self, token: int) -> None:
        """Record a sampled token and decide whether the request has finished."""
        self.token_ids.append(token)
        params = self.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token in params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_len:
            self.finish_reason = "length"

    def __repr__(self) -> str:
        return (
            f"Req(uid={self.uid}, seq_len={self.seq_len}, cached_len={self.cached_len}, "
            f"table_idx={self.table_idx}, pages={len(self.pages)})"
        )


@dataclass
class Batch:
    """One forward step. `reqs` each carry their `extend_len` for this step."""

    reqs: list[Req]

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)

    @property
    def is_decode(self) -> bool:
        return all(r.extend_len == 1 for r in self.reqs)

    @property
    def sampling_reqs(self) -> list[Req]:
        return [r for r in self.reqs if r.samples_this_step]
