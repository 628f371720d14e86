"""Prompt logprobs: how likely the model found each prompt token, computed in the prefill
step that reads it (completions' `echo` with `logprobs`, `SamplingParams.prompt_logprobs`).

Contract: `score_prompts(model, hidden, batch, staging)` takes a prefill step's hidden
states, (T, hidden) for every token the step fed, and the step's `batch.scoring` entries
(see core.Batch). For each entry it computes, at each of its positions p, the
log-softmax of the model's raw logits (before any logits processor or temperature, as for
sampled tokens) and reads off the logprob of the prompt token at p + 1 and the top
`prompt_logprobs` alternatives. The work is queued on the device at once;
`DevicePromptScores.to_host()` later returns one list of `TokenLogprob` per entry, in
order, waiting for the device then.

Positions are scored in blocks of at most `BLOCK`, so a long chunk never holds
(chunk, vocab) float32 logits at once: the extra memory is (BLOCK, vocab) whatever the
chunk. A chunk is scored exactly as the same positions are in a single chunk: the hidden
state of a position does not depend on how the prompt was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.message import TokenLogprob
from minisgl.utils.staging import Staging

BLOCK = 256  # positions whose (BLOCK, vocab) logits exist at once


@dataclass
class DevicePromptScores:
    """What `score_prompts` queued, still on the device."""

    counts: list[tuple[int, int]]  # per entry: (positions, alternatives)
    chosen: torch.Tensor  # (P,) each position's next prompt token's logprob
    top_values: torch.Tensor  # (P, k_max) the best alternatives' logprobs, best first
    top_ids: torch.Tensor  # (P, k_max) their token ids

    def to_host(self) -> list[list[TokenLogprob]]:
        chosen = self.chosen.tolist()
        top_v, top_i = self.top_values.tolist(), self.top_ids.tolist()
        out, pos = [], 0
        for count, k in self.counts:
            out.append(
                [
                    TokenLogprob(chosen[p], list(zip(top_i[p][:k], top_v[p][:k])))
                    for p in range(pos, pos + count)
                ]
            )
            pos += count
        return out


def score_prompts(
    model, hidden: torch.Tensor, batch: Batch, staging: Staging
) -> DevicePromptScores:
    """hidden: (T, hidden) of the step's tokens; `model.logits` maps rows to logits."""
    rows: list[int] = []  # rows of `hidden` to score
    targets: list[int] = []  # the prompt token each row scores
    counts: list[tuple[int, int]] = []
    for i, start, count, row in batch.scoring:
        req = batch.reqs[i]
        rows += range(row, row + count)
        targets += req.token_ids[start + 1 : start + 1 + count]
        counts.append((count, req.sampling_params.prompt_logprobs or 0))
    k_max = max(k for _, k in counts)
    rows_d = staging.to_device(rows, torch.int64)
    targets_d = staging.to_device(targets, torch.int64)
    chosen, top_v, top_i = [], [], []
    for b in range(0, len(rows), BLOCK):
        logp = model.logits(hidden[rows_d[b : b + BLOCK]]).log_softmax(dim=-1)  # (<=BLOCK, V)
        chosen.append(logp.gather(1, targets_d[b : b + BLOCK, None]).squeeze(1))
        if k_max:
            values, ids = logp.topk(k_max, dim=-1)
            top_v.append(values)
            top_i.append(ids)
    P = len(rows)
    empty_v = hidden.new_zeros((P, 0), dtype=torch.float32)
    return DevicePromptScores(
        counts,
        torch.cat(chosen),
        torch.cat(top_v) if k_max else empty_v,
        torch.cat(top_i) if k_max else empty_v.long(),
    )
