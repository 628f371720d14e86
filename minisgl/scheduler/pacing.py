"""PrefillPacer: how many prompt tokens one step may prefill while other sequences decode.

Contract: `budget(decoding)` is the prefill token budget of the next step: with no sequence
decoding, `max_tokens` (a lone prompt prefills as fast as it can); with some decoding, as
many tokens as fit in about `step_seconds` at the speed the engine has shown, so that
their next tokens are never held back much longer than that by somebody else's long
prompt. `observe(prefill, decodes, seconds)` reports a step that ran synchronously (the
CPU, where a step runs inside its launch): its prefill and decode tokens and how long it
took. `step_seconds` None turns pacing off (CUDA, where a step of max_tokens is a fraction
of a second anyway and launches do not wait for it).

Why: on a CPU a chunk of 8192 prompt tokens is a minute of work; every stream decoding
beside it would stop for that minute.
"""

from __future__ import annotations

MIN_TOKENS = 16  # a long prompt still moves on, however slow the machine
SMOOTHING = 0.3  # weight of the newest step in the speed estimate


class PrefillPacer:
    def __init__(self, max_tokens: int, step_seconds: float | None) -> None:
        self.max_tokens = max_tokens
        self.step_seconds = step_seconds
        self.seconds_per_token: float | None = None  # unknown until a step is observed

    def budget(self, decoding: int) -> int:
        if decoding == 0 or self.step_seconds is None:
            return self.max_tokens
        if self.seconds_per_token is None:  # not measured yet: a cautious first chunk
            return min(self.max_tokens, 8 * MIN_TOKENS)
        tokens = int(self.step_seconds / self.seconds_per_token) - decoding
        return max(MIN_TOKENS, min(self.max_tokens, tokens))

    def observe(self, prefill: int, decodes: int, seconds: float) -> None:
        if self.step_seconds is None or prefill == 0 or seconds <= 0:
            return  # decode-only steps say little about the cost of prompt tokens
        per_token = seconds / (prefill + decodes)
        old = self.seconds_per_token
        self.seconds_per_token = (
            per_token if old is None else SMOOTHING * per_token + (1 - SMOOTHING) * old
        )
