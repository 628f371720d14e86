"""Logits processors: what a request's parameters change in its logits before sampling.

Contract: `LogitsProcessors.prepare(reqs, staging, penalties)` returns None when no request of
the step needs processing (the common case: no work at all), else the small tensors below,
built once per step; `apply(logits)` then edits (B, V) logits in place, in OpenAI/vLLM order:
1. logit_bias: added to the named tokens;
2. min_tokens: end tokens (EOS, stop_token_ids) get -inf while the sequence is shorter;
3. repetition_penalty (prompt and output tokens seen), then presence and frequency
   penalties (output tokens, by occurrence).
After the step's tokens are sampled, `record(tokens)` adds them to the penalty statistics;
it must run exactly once per `prepare` (the sampler does it).

Penalties read their token statistics from a `PenaltyState` on the device: one row per
page-table slot, holding the output-token counts and the prompt+output "seen" flags of the
sequence that owns the slot. A row is built from the host's token lists once, when a
sequence first samples in that slot; from then on `record` adds every sampled token on the
device. So the latest token counts even while it is still pending (sampled on the device,
not yet in `token_ids`), and no step rebuilds (B, V) tensors from Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.utils.staging import Staging


class PenaltyState:
    """Per-slot token statistics for penalties, kept on the device.

    counts[s, v]: occurrences of token v in the output of the sequence owning slot s;
    seen[s, v]: whether v is in that sequence's prompt or output. Allocated on the first
    request with penalties, so a server that never sees one never pays the
    (max_slots, V) memory."""

    def __init__(self, max_slots: int, vocab: int, staging: Staging) -> None:
        self.max_slots, self.vocab = max_slots, vocab
        self.staging, self.device = staging, staging.device
        self.counts: torch.Tensor | None = None  # (max_slots, V) float32
        self.seen: torch.Tensor | None = None  # (max_slots, V) bool
        # the sequence whose statistics each row holds: Req objects compare by identity,
        # so a new sequence in a slot (a different object) always gets a fresh row
        self.owner: list[Req | None] = [None] * max_slots

    def claim(self, reqs: list[Req]) -> torch.Tensor:
        """The slots of `reqs` (a (P,) device tensor), after (re)building the rows of those
        that sample in their slot for the first time."""
        if self.counts is None:
            self.counts = torch.zeros(self.max_slots, self.vocab, device=self.device)
            self.seen = torch.zeros(
                self.max_slots, self.vocab, dtype=torch.bool, device=self.device
            )
        for r in reqs:
            if not 0 <= r.table_idx < self.max_slots:
                raise ValueError(f"{r} has no page-table slot below {self.max_slots}")
        fresh = [r for r in reqs if self.owner[r.table_idx] is not r]
        if fresh:
            self._build(fresh)
        return self.staging.to_device([r.table_idx for r in reqs], torch.int64)

    def _build(self, reqs: list[Req]) -> None:
        """Fill the rows of `reqs`' slots from their host token lists."""
        out_slots, out_ids, seen_slots, seen_ids = [], [], [], []
        for r in reqs:
            # the row is built from token_ids: a token still on the device would be missing.
            # The scheduler never (re)prefills a sequence while its last token is pending.
            assert r.num_pending == 0, f"{r} has a pending token"
            # a sequence that moved slots (preempted, re-admitted elsewhere) leaves its old
            # row behind: forget it, or coming back there later would find it stale
            self.owner = [None if o is r else o for o in self.owner]
            self.owner[r.table_idx] = r
            out_slots += [r.table_idx] * len(r.output_ids)
            out_ids += r.output_ids
            seen_slots += [r.table_idx] * len(r.token_ids)
            seen_ids += r.token_ids

        def to_device(data):
            return self.staging.to_device(data, torch.int64)

        slots = to_device([r.table_idx for r in reqs])
        self.counts.index_fill_(0, slots, 0.0)
        self.seen.index_fill_(0, slots, False)
        self.counts.index_put_(
            (to_device(out_slots), to_device(out_ids)),
            torch.ones(len(out_ids), device=self.device),
            accumulate=True,  # a token may occur several times
        )
        self.seen[to_device(seen_slots), to_device(seen_ids)] = True

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one sampled token per slot ((P,) device tensors; slots distinct), on the device."""
        self.counts.index_put_(
            (slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True
        )
        self.seen[slots, tokens] = True


@dataclass
class LogitsProcessors:
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids -> -inf
    # penalties, for the P rows of the batch that have any (P <= B):
    penalized: torch.Tensor | None = None  # (P,) their rows in the batch
    slots: torch.Tensor | None = None  # (P,) their rows in `state`
    state: PenaltyState | None = None
    presence: torch.Tensor | None = None  # (P, 1)
    frequency: torch.Tensor | None = None  # (P, 1)
    repetition: torch.Tensor | None = None  # (P, 1)

    @classmethod
    def prepare(
        cls, reqs: list[Req], staging: Staging, penalties: PenaltyState
    ) -> LogitsProcessors | None:
        params = [r.sampling_params for r in reqs]
        need_bias = any(p.logit_bias for p in params)
        need_ban = any(r.output_len < p.min_tokens for r, p in zip(reqs, params))
        need_penalty = any(p.has_penalties for p in params)
        if not (need_bias or need_ban or need_penalty):
            return None

        to_device = staging.to_device

        procs = cls(None, None)
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
                if r.output_len < p.min_tokens:  # output_len counts a pending token
                    rows += [i] * len(r.stop_token_set)
                    ids += list(r.stop_token_set)
            procs.banned = (to_device(rows, torch.int64), to_device(ids, torch.int64))
        if need_penalty:
            rows = [i for i, p in enumerate(params) if p.has_penalties]
            pen = [params[i] for i in rows]
            procs.penalized = to_device(rows, torch.int64)
            procs.slots = penalties.claim([reqs[i] for i in rows])
            procs.state = penalties
            procs.presence = to_device([p.presence_penalty for p in pen], torch.float32)[:, None]
            procs.frequency = to_device([p.frequency_penalty for p in pen], torch.float32)[:, None]
            procs.repetition = to_device([p.repetition_penalty for p in pen], torch.float32)[
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
        if self.penalized is not None:
            x = logits[self.penalized]  # (P, V): only the rows with penalties pay for them
            x = self._repetition(x)
            logits[self.penalized] = self._presence_frequency(x)
        return logits

    def _repetition(self, x: torch.Tensor) -> torch.Tensor:
        """Seen tokens' logits move toward zero: divided by the penalty if positive, else
        multiplied. Unseen tokens get a penalty of 1.0, which changes nothing exactly."""
        penalty = torch.where(self.state.seen[self.slots], self.repetition, 1.0)  # (P, V)
        positive = x > 0
        divided = x / penalty
        return torch.where(positive, divided, x.mul_(penalty))

    def _presence_frequency(self, x: torch.Tensor) -> torch.Tensor:
        """Subtract presence once from each token present in the output, frequency once per
        occurrence."""
        counts = self.state.counts[self.slots]  # (P, V), a copy we may overwrite
        present = counts > 0
        x -= counts.mul_(self.frequency).add_(self.presence * present)
        return x

    def record(self, tokens: torch.Tensor) -> None:
        """Add the step's sampled tokens ((B,) device tensor) to the penalty statistics."""
        if self.penalized is not None:
            self.state.record(self.slots, tokens[self.penalized])
