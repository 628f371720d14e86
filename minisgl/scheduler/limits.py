"""What the engine can hold: the scheduling policy's only view of it.

Contract: `Limits` is a frozen record of the numbers the policy decides with: the context a
sequence may fill (`max_seq_len`: prompt and output together), the vocabulary (token ids
must be below `vocab_size`; `eos_token_ids` end a sequence), the KV pool (`num_pages` of
`page_size` tokens), the table slots (`max_running_requests`: sequences that hold pages at
once), `prefill_rows`, the rows a step carrying a prompt chunk should reach (the prefill
pacer's floor: 1, or more where a step's cost has a part that enough rows share, as on
int4 weights), and `attention_context`, the position at which a row's attention costs as
much as its linear layers (the pacer's cost of a row deep in a long prompt; infinite:
never). `Limits.of(engine)` reads them off a built engine; a unit test writes them down
and builds the policy without a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    vocab_size: int
    num_pages: int
    page_size: int
    max_running_requests: int
    eos_token_ids: frozenset[int] = frozenset()
    prefill_rows: int = 1
    attention_context: float = math.inf

    @classmethod
    def of(cls, engine: Any) -> Limits:
        """The limits of a built engine (engine/engine.py)."""
        model = engine.model_config
        return cls(
            max_seq_len=engine.max_seq_len,
            vocab_size=model.vocab_size,
            num_pages=engine.num_pages,
            page_size=engine.page_size,
            max_running_requests=engine.config.max_running_requests,
            eos_token_ids=model.eos_token_ids,
            prefill_rows=engine.prefill_rows,
            attention_context=attention_context(model),
        )


def attention_context(model: Any) -> float:
    """Where a row's attention (4 * p * q_size multiply-adds per layer at position p: the
    scores and the weighted sum) costs as much as its linear layers (2 per weight: the
    q/k/v/o projections and a gated MLP), counted in multiply-adds of `model` (a
    ModelConfig). The CPU runs both at about the same rate per multiply-add; the pacer's
    measured speed absorbs the rest."""
    hidden, q, kv = model.hidden_size, model.q_size, model.kv_size
    linear = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * model.intermediate_size
    return linear / (2 * q)
