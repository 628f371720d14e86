"""PrefillPacer: how many prompt tokens one step may prefill while other sequences decode.

Contract: `budget(decoding)` is the prefill token budget of the next step: with no sequence
decoding, `max_tokens` (a lone prompt prefills as fast as it can); with some decoding, as
many tokens as fit in about `step_seconds` at the speed the engine has shown, so that
their next tokens are never held back much longer than that by somebody else's long
prompt, but never so few that the step stays under `min_rows` rows (nor under MIN_TOKENS,
nor over `max_tokens`). `observe(prefill, decodes, seconds)` reports a step that ran
synchronously (the CPU, where a step runs inside its launch): its prefill and decode tokens
and how long it took. `step_seconds` None turns pacing off (CUDA, where a step of
max_tokens is a fraction of a second anyway and launches do not wait for it).

Why pace: on a CPU a chunk of 8192 prompt tokens is a minute of work; every stream
decoding beside it would stop for that minute.

Why `min_rows`: the engine's `Limits.prefill_rows`. Where a step has a cost of its own that
its rows share (on int4 weights, dequantizing every weight once for a GEMM: models/quant.py),
the speed estimate above, which charges every token the same, would keep chunks too small
to share it; so a chunk beside decodes takes the step to `min_rows`. The figures behind
these choices are in benchmarks/RESULTS.md ("Why the CPU path is shaped as it is").
"""

from __future__ import annotations

from typing import Any

MIN_TOKENS = 16  # a long prompt still moves on, however slow the machine
DEFAULT_CPU_STEP_SECONDS = 0.3  # SchedulerConfig.prefill_step_seconds on a CPU
SMOOTHING = 0.3  # weight of the newest step in the speed estimate


class PrefillPacer:
    def __init__(self, max_tokens: int, step_seconds: float | None, min_rows: int = 1) -> None:
        self.max_tokens = max_tokens
        self.step_seconds = step_seconds
        self.min_rows = min_rows
        self.seconds_per_token: float | None = None  # unknown until a step is observed

    @classmethod
    def configured(cls, config: Any, on_cpu: bool, min_rows: int) -> PrefillPacer:
        """The pacer `config` (a SchedulerConfig) asks for: its `prefill_step_seconds`, by
        default DEFAULT_CPU_STEP_SECONDS on a CPU (a step runs inside its launch there: it
        can be timed and paced) and off elsewhere; 0 is off."""
        pace = config.prefill_step_seconds
        if pace is None:
            pace = DEFAULT_CPU_STEP_SECONDS if on_cpu else 0
        return cls(config.max_prefill_tokens, pace or None, min_rows=min_rows)

    def budget(self, decoding: int) -> int:
        if decoding == 0 or self.step_seconds is None:
            return self.max_tokens
        if self.seconds_per_token is None:  # not measured yet: a cautious first chunk
            tokens = 8 * MIN_TOKENS
        else:
            tokens = int(self.step_seconds / self.seconds_per_token) - decoding
        floor = max(MIN_TOKENS, self.min_rows - decoding)
        return min(self.max_tokens, max(floor, tokens))

    def observe(self, prefill: int, decodes: int, seconds: float) -> None:
        if self.step_seconds is None or prefill == 0 or seconds <= 0:
            return  # decode-only steps say little about the cost of prompt tokens
        per_token = seconds / (prefill + decodes)
        old = self.seconds_per_token
        self.seconds_per_token = (
            per_token if old is None else SMOOTHING * per_token + (1 - SMOOTHING) * old
        )
