"""PrefillPacer: how much prompt one step may prefill, so that nobody waits long for a step.

Contract: `budget(decodes, waiting)` is the next step's `ChunkBudget`: the work its prompt
chunks may do. Work is counted in rows, each prompt row at position p costing
`1 + p / attention_context` (its linear layers, then its attention over the p positions
before it: the engine's `Limits.attention_context` is where the two cost the same), so a
chunk deep into a long prompt gets fewer rows than one at its start. The step should take
about `step_seconds` (the target) at the speed the engine has shown, the decoding
sequences' own work included; with nobody decoding and one sequence waiting it may take
ALONE times the target, since a newcomer waits at most one step for its turn. Every chunk
budget lets a step make progress (MIN_TOKENS rows), and is raised to `min_rows` rows where
that still fits in CEILING times the target. `observe(batch, seconds)` reports a step that
ran synchronously (the CPU, where a step runs inside its launch). `step_seconds` None turns
pacing off (CUDA, where a step of max_tokens is a fraction of a second anyway and launches
do not wait for it): the budget is then `max_tokens` rows, whatever their positions.

Why pace: on a CPU a chunk of 8192 prompt tokens is a minute of work; every other request
would wait that minute for its next token, or its first.

Why `min_rows`: the engine's `Limits.prefill_rows`. Where a step has a cost of its own that
its rows share (on int4 weights, dequantizing every weight once for a GEMM: models/quant.py),
a chunk too small to share it makes every prompt token several times dearer; so a chunk
takes the step to `min_rows` while the step stays within the ceiling. The figures behind
these choices are in benchmarks/RESULTS.md ("Why the CPU path is shaped as it is").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MIN_TOKENS = 16  # a long prompt still moves on, however slow the machine
DEFAULT_CPU_STEP_SECONDS = 0.3  # SchedulerConfig.prefill_step_seconds on a CPU
ALONE = 3  # targets a step may take with nobody decoding and one sequence waiting
CEILING = 2  # targets a step raised to `min_rows` may take
SMOOTHING = 0.3  # weight of the newest step in the speed estimate


def row_work(rows: int, context: int, attention_context: float) -> float:
    """The work of `rows` consecutive rows from position `context` on."""
    return rows * (1 + (context + (rows - 1) / 2) / attention_context)


def rows_within(work: float, context: int, attention_context: float) -> int:
    """The most rows from position `context` on whose work is at most `work`."""
    if work < 1:
        return 0
    if math.isinf(attention_context):
        return int(work)
    # rows * (1 + (context + (rows - 1) / 2) / a) = work, for rows: a quadratic
    a = attention_context
    b = 1 + (context - 0.5) / a
    rows = int((-b + math.sqrt(b * b + 2 * work / a)) * a)
    while rows > 0 and row_work(rows, context, a) > work:  # float rounding, either way
        rows -= 1
    while row_work(rows + 1, context, a) <= work:
        rows += 1
    return rows


class ChunkBudget:
    """The prompt work one step may still do: `rows_at(context)` rows may a chunk from
    position `context` take now; `spend(rows, context)` takes a chunk's work off."""

    def __init__(
        self, work: float, attention_context: float = math.inf, floor: int = 0, ceiling: float = 0
    ) -> None:
        self.work = work
        self.attention_context = attention_context
        self.floor = floor  # rows every step may take, whatever their work
        self.ceiling = ceiling  # the work a step raised to `floor` rows may do

    def rows_at(self, context: int) -> int:
        rows = rows_within(self.work, context, self.attention_context)
        if self.floor > rows:
            fits = row_work(self.floor, context, self.attention_context) <= self.ceiling
            rows = self.floor if fits else max(rows, min(self.floor, MIN_TOKENS))
        return rows

    def spend(self, rows: int, context: int) -> None:
        work = row_work(rows, context, self.attention_context)
        self.work -= work
        self.ceiling -= work
        self.floor = max(0, self.floor - rows)


class PrefillPacer:
    def __init__(
        self,
        max_tokens: int,
        step_seconds: float | None,
        min_rows: int = 1,
        attention_context: float = math.inf,
    ) -> None:
        self.max_tokens = max_tokens
        self.step_seconds = step_seconds
        self.min_rows = min_rows
        self.attention_context = attention_context
        self.seconds_per_row: float | None = None  # of a row at position 0; unknown yet

    @classmethod
    def configured(cls, config: Any, on_cpu: bool, limits: Any) -> PrefillPacer:
        """The pacer `config` (a SchedulerConfig) asks for over an engine's `limits`: its
        `prefill_step_seconds`, by default DEFAULT_CPU_STEP_SECONDS on a CPU (a step runs
        inside its launch there: it can be timed and paced) and off elsewhere; 0 is off."""
        pace = config.prefill_step_seconds
        if pace is None:
            pace = DEFAULT_CPU_STEP_SECONDS if on_cpu else 0
        return cls(
            config.max_prefill_tokens,
            pace or None,
            min_rows=limits.prefill_rows,
            attention_context=limits.attention_context,
        )

    def budget(self, decodes: Sequence[Any] = (), waiting: int = 1) -> ChunkBudget:
        """The prompt work of the next step beside `decodes` (sequences decoding one token
        each, at their `cached_len`), with `waiting` sequences to prefill."""
        if self.step_seconds is None:
            return ChunkBudget(self.max_tokens)
        if self.seconds_per_row is None:  # not measured yet: a cautious first chunk
            return ChunkBudget(0, floor=min(8 * MIN_TOKENS, self.max_tokens), ceiling=math.inf)
        target = self.step_seconds * (ALONE if not decodes and waiting <= 1 else 1)
        decoding = sum(self.work(1, r.cached_len) for r in decodes)
        work = min(target / self.seconds_per_row - decoding, self.max_tokens)
        floor = max(MIN_TOKENS, self.min_rows - len(decodes))
        ceiling = CEILING * self.step_seconds / self.seconds_per_row - decoding
        budget = ChunkBudget(work, self.attention_context, min(floor, self.max_tokens), ceiling)
        return budget

    def work(self, rows: int, context: int) -> float:
        return row_work(rows, context, self.attention_context)

    def observe(self, batch: Any, seconds: float) -> None:
        """A step over `batch` (core.Batch, its sequences' state as launched) took `seconds`."""
        if self.step_seconds is None or seconds <= 0 or len(batch.reqs) == batch.decodes:
            return  # decode-only steps say little about the cost of prompt tokens
        work = sum(self.work(r.extend_len, r.cached_len) for r in batch.reqs)
        per_row = seconds / work
        old = self.seconds_per_row
        self.seconds_per_row = (
            per_row if old is None else SMOOTHING * per_row + (1 - SMOOTHING) * old
        )
