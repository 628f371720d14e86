"""Logits processors: what a request's parameters change in its logits before sampling.

Contract: `LogitsProcessors.prepare(reqs, vocab, device)` returns None when no request of
the step needs processing (the common case: no work at all), else the tensors below, built
once per step; `apply(logits)` then edits (B, V) logits in place, in OpenAI/vLLM order:
1. logit_bias: added to the named tokens;
2. min_tokens: end tokens (EOS, stop_token_ids) get -inf while the sequence is shorter;
3. repetition_penalty (prompt and output tokens seen), then presence and frequency
   penalties (output tokens, by occurrence).
Building the tensors walks the token lists of the requests that asked for penalties; requests
that did not cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req


@dataclass
class LogitsProcessors:
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids -> -inf
    counts: torch.Tensor | None  # (B, V) float32: occurrences in the output so far
    seen: torch.Tensor | None  # (B, V) bool: in the prompt or the output
    presence: torch.Tensor | None  # (B, 1)
    frequency: torch.Tensor | None  # (B, 1)
    repetition: torch.Tensor | None  # (B, 1)

    @classmethod
    def prepare(cls, reqs: list[Req], vocab: int, device: torch.device) -> LogitsProcessors | None:
        params = [r.sampling_params for r in reqs]
        need_bias = any(p.logit_bias for p in params)
        need_ban = any(r.output_len < p.min_tokens for r, p in zip(reqs, params))
        need_penalty = any(p.has_penalties for p in params)
        if not (need_bias or need_ban or need_penalty):
            return None

        def to_device(data, dtype):
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        procs = cls(None, None, None, None, None, None, None)
        if need_bias:
            rows, ids, values = [], [], []
            for i, p in enumerate(params):
                rows += [i] * len(p.logit_bias)
                ids += list(p.logit_bias)
                values += list(p.logit_bias.values())
            procs.bias = (
                to_device(rows, torch.int64),
                to_device(ids, torch.int64),
                to_device(values, torch.float32),
            )
        if need_ban:
            rows, ids = [], []
            for i, (r, p) in enumerate(zip(reqs, params)):
                if r.output_len < p.min_tokens:
                    rows += [i] * len(r.stop_token_set)
                    ids += list(r.stop_token_set)
            procs.banned = (to_device(rows, torch.int64), to_device(ids, torch.int64))
        if need_penalty:
            B = len(reqs)
            out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
            for i, r in enumerate(reqs):
                if r.sampling_params.has_penalties:
                    out = r.output_ids
                    out_rows += [i] * len(out)
                    out_ids += out
                    seen_rows += [i] * r.seq_len
                    seen_ids += r.token_ids
            counts = torch.zeros(B, vocab, device=device)
            counts.index_put_(
                (to_device(out_rows, torch.int64), to_device(out_ids, torch.int64)),
                torch.ones(len(out_ids), device=device),
                accumulate=True,
            )
            seen = torch.zeros(B, vocab, dtype=torch.bool, device=device)
            seen[to_device(seen_rows, torch.int64), to_device(seen_ids, torch.int64)] = True
            procs.counts, procs.seen = counts, seen
            procs.presence = to_device([p.presence_penalty for p in params], torch.float32)[:, None]
            procs.frequency = to_device([p.frequency_penalty for p in params], torch.float32)[
                :, None
            ]
            procs.repetition = to_device([p.repetition_penalty for p in params], torch.float32)[
                :, None
            ]
        return procs

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit (B, V) float32 logits in place and return them."""
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.banned is not None:
            rows, ids = self.banned
            logits[rows, ids] = float("-inf")
        if self.counts is not None:
            # repetition: seen tokens' logits move toward zero (divided if positive)
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits.copy_(torch.where(self.seen, penalized, logits))
            logits -= self.presence * (self.counts > 0) + self.frequency * self.counts
        return logits
