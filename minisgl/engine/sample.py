"""Batched sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Contract: `Sampler.prepare(reqs)` turns the sequences that sample this step into tensors
once; `Sampler.sample(logits, args)` picks one token per row with tensor ops only (no Python
loop over requests, no host sync): logits processors first (logits.py), then greedy or
temperature / top-k / top-p sampling; it also records the tokens for the penalties, so it
runs exactly once per `prepare`. `Sampler.logprobs` reports, for the rows that asked, the
sampled token's log-probability and the top alternatives, from the model's raw distribution
(before processors and temperature, as vLLM reports them by default); `logprobs_device`
does its device work at once and `.to_host()` reads the result later.

Randomness is counter-based: request r at output index s draws one uniform number u, a hash
of (seed_r, s), and takes the token where the cumulative distribution of
softmax(logits / T), over the tokens its filters keep, in token-id order, passes u
(inverse-CDF sampling). The token is thus a pure function of (seed, output index, logits):
the same seed draws the same tokens whatever else shares the batch, and again after being
preempted and recomputed. Greedy rows take the argmax of the processed logits. top-k and
top-p keep the tokens tied with the last one they keep, so ties never depend on a sort.

Memory: besides the (B, V) copy of the logits that the sampler edits in place, a sampling
step makes one more (B, V) float32 tensor (the cumulative sums); top-k adds a (B, k_max)
`topk` and a (B, V) bool mask; only top-p sorts the vocabulary (values, indices and their
cumulative sums, freed before the draw). Nothing of (B, V) is built when every row is greedy
and no processor applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Req
from minisgl.distributed import TPInfo, broadcast_
from minisgl.message import TokenLogprob
from minisgl.utils.staging import Staging

from . import grammar
from .logits import LogitsProcessors, PenaltyState

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): every input bit affects every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(B,) int64 seeds and output indices -> (B,) float32 in (0, 1), a pure function of
    (seed, step). 23 random bits: (n + 0.5) / 2**23 is exact in float32 and never 0 or 1."""
    seed_lo, seed_hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(seed_lo ^ _mix32(seed_hi ^ 0x5BD1E995))
    bits = _mix32(key ^ _mix32((steps & _M32) ^ 0x27D4EB2F))
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


# --8<-- [start:argmax]
_BLOCK = 128  # tokens per block of the blocked argmax
_BLOCKED_MIN = 32_768  # logits (B * V) from which the blocked argmax is faster


def greedy_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, V) logits -> (B,) int64: the index of each row's maximum, the first one where
    several are equal (NaN counting as the maximum), exactly `x.argmax(-1)`.

    On a CPU, torch's argmax kernel reads a row one element at a time (about 13 us per
    49,152-token row on a 2-core EPYC, ten times an `amax` of the same row). So a large
    batch is cut into blocks of 128 tokens: the vectorised `amax` of every block, the first
    block whose maximum is the row's (an argmax over V / 128 values), then an argmax inside
    that block. Both argmaxes take the first of equal values, so ties resolve as in one
    argmax. About 3x faster from a few rows of a real vocabulary up; a GPU's argmax is
    parallel already."""
    B, V = x.shape
    if x.device.type != "cpu" or V % _BLOCK or B * V < _BLOCKED_MIN or not x.is_contiguous():
        return x.argmax(dim=-1)
    blocks = x.view(B, V // _BLOCK, _BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # (B,) the first block holding the maximum
    inside = blocks[torch.arange(B), best].argmax(dim=-1)
    return best * _BLOCK + inside


# --8<-- [end:argmax]


def _as_int64(seed: int) -> int:
    """Any Python int -> the signed 64-bit value with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingArgs:
    greedy_only: bool
    processors: LogitsProcessors | None = None
    logprob_rows: list[tuple[int, int]] | None = None  # (row, alternatives) asking logprobs
    logprob_index: torch.Tensor | None = None  # (R,) the same rows, on the device
    temperature: torch.Tensor | None = None  # (B, 1) float32, 1.0 on greedy rows
    greedy: torch.Tensor | None = None  # (B,) bool
    top_k: torch.Tensor | None = None  # (B, 1) int64, 0 where off
    top_k_max: int = 0  # the largest k: known on the host, so `topk` needs no sync
    top_p: torch.Tensor | None = None  # (B, 1) float32, 1.0 where off
    seeds: torch.Tensor | None = None  # (B,) int64
    steps: torch.Tensor | None = None  # (B,) int64: output index being sampled
    grammar_rows: list[tuple[int, Any]] | None = None  # (row, matcher) of constrained rows


@dataclass
class DeviceLogprobs:
    """What `Sampler.logprobs_device` computed, still on the device."""

    batch_size: int
    rows: list[tuple[int, int]]  # (row, alternatives), as in SamplingArgs.logprob_rows
    chosen: torch.Tensor  # (R,) the sampled token's logprob
    top_values: torch.Tensor  # (R, k_max) the best alternatives' logprobs, best first
    top_ids: torch.Tensor  # (R, k_max) their token ids

    def to_host(self) -> list[TokenLogprob | None]:
        """Per row of the batch: its TokenLogprob, or None if it did not ask (waits for the
        device)."""
        chosen = self.chosen.tolist()
        top_v, top_i = self.top_values.tolist(), self.top_ids.tolist()
        out: list[TokenLogprob | None] = [None] * self.batch_size
        for j, (row, k) in enumerate(self.rows):
            out[row] = TokenLogprob(chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return out


class Sampler:
    def __init__(
        self, vocab_size: int, device: torch.device, max_slots: int, tp: TPInfo | None = None
    ) -> None:
        """`max_slots`: page-table slots; every request passed in holds one below it.
        `tp`: the engine's ranks, which all take rank 0's tokens."""
        self.vocab_size = vocab_size
        self.tp = tp or TPInfo()
        self.device = device
        self.staging = Staging(device)  # every tensor prepare() makes comes through here
        self.penalties = PenaltyState(max_slots, vocab_size, self.staging)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return self.staging.to_device(data, dtype)

    def prepare(self, reqs: list[Req]) -> SamplingArgs:
        """Call before the step's tokens are marked pending: `output_len` is then the index
        of the token this step samples."""
        if all(r.plain_greedy for r in reqs):  # the common case: nothing to prepare
            return SamplingArgs(True)
        params = [r.sampling_params for r in reqs]
        processors = LogitsProcessors.prepare(reqs, self.staging, self.penalties)
        grammar_rows = [(i, r.matcher) for i, r in enumerate(reqs) if r.matcher is not None]
        logprob_rows = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        args = SamplingArgs(all(p.is_greedy for p in params), processors)
        args.grammar_rows = grammar_rows or None
        if logprob_rows:
            args.logprob_rows = logprob_rows
            args.logprob_index = self._tensor([i for i, _ in logprob_rows], torch.int64)
        if args.greedy_only:
            return args
        greedy = [p.is_greedy for p in params]
        args.greedy = self._tensor(greedy, torch.bool)
        args.temperature = self._tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32
        )[:, None]
        args.seeds = self._tensor([_as_int64(r.seed) for r in reqs], torch.int64)
        args.steps = self._tensor([r.output_len for r in reqs], torch.int64)
        # greedy rows draw too (the draw is thrown away): no filters for them, so they never
        # cost a top-k or a sort
        V = self.vocab_size
        ks = [p.top_k if not g and 0 < p.top_k < V else 0 for g, p in zip(greedy, params)]
        if any(ks):
            args.top_k = self._tensor(ks, torch.int64)[:, None]
            args.top_k_max = max(ks)
        ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        if any(p < 1.0 for p in ps):
            args.top_p = self._tensor(ps, torch.float32)[:, None]
        return args

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """logits: (B, V) float32 (left untouched) -> (B,) int64 token ids."""
        x = logits
        if args.processors is not None:
            x = args.processors.apply(logits.clone())
        if args.grammar_rows is not None:  # last: nothing may unmask a token again
            x = x.clone() if x is logits else x
            grammar.mask(x, args.grammar_rows, self.staging)
        greedy = greedy_tokens(x)
        tokens = greedy
        if not args.greedy_only:
            x = x.clone() if x is logits else x  # the draw edits x in place
            tokens = torch.where(args.greedy, greedy, _draw(x, greedy, args))
        # with tensor parallelism rank 0's draw is every rank's: one token stream, however
        # the ranks' arithmetic differs
        broadcast_(tokens, self.tp)
        if args.processors is not None:
            args.processors.record(tokens)
        return tokens

    @staticmethod
    def logprobs_device(
        raw_logits: torch.Tensor, tokens: torch.Tensor, args: SamplingArgs
    ) -> DeviceLogprobs | None:
        """The device half of `logprobs`: no host sync; `.to_host()` on the result later."""
        if args.logprob_rows is None:
            return None
        rows = args.logprob_index
        logp = raw_logits[rows].log_softmax(dim=-1)  # (R, V)
        chosen = logp.gather(1, tokens[rows][:, None]).squeeze(1)
        k_max = max(k for _, k in args.logprob_rows)
        top_v, top_i = logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long())
        return DeviceLogprobs(raw_logits.shape[0], args.logprob_rows, chosen, top_v, top_i)

    @staticmethod
    def logprobs(
        raw_logits: torch.Tensor, tokens: torch.Tensor, args: SamplingArgs
    ) -> list[TokenLogprob | None] | None:
        """Per row: the sampled token's logprob and its top alternatives, or None."""
        device_part = Sampler.logprobs_device(raw_logits, tokens, args)
        return None if device_part is None else device_part.to_host()


def _draw(x: torch.Tensor, greedy: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
    """Inverse-CDF draw from softmax(x / T) over the tokens the filters keep.

    x: (B, V) processed logits, overwritten; greedy: (B,) their argmax -> (B,) token ids."""
    x.div_(args.temperature)  # greedy rows have T = 1
    if args.top_k is not None or args.top_p is not None:
        _filter_top_k_top_p(x, args)
    # unnormalised probabilities exp(x - max): the top token gets exactly 1, filtered ones 0
    x.sub_(x.gather(1, greedy[:, None])).exp_()
    cdf = x.cumsum(dim=-1)  # (B, V), in token-id order
    target = seeded_uniform(args.seeds, args.steps)[:, None] * cdf[:, -1:]
    # the first token whose cumulative mass passes u * total
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=x.shape[-1] - 1)
    # rounding can land past the end or on a zero-probability token (a filtered or banned
    # one: a parallel cumsum need not be exactly flat over zeros). That has odds of about
    # 2**-23; take the row's top token then, which is always allowed.
    allowed = x.gather(1, idx) > 0
    return torch.where(allowed, idx, greedy[:, None]).squeeze(1)


def _filter_top_k_top_p(x: torch.Tensor, args: SamplingArgs) -> None:
    """Set to -inf, in place, each row's logits outside its top k, then outside its top-p
    nucleus of what is left (the top token always stays). Tokens tied with the last one kept
    stay too, so what a row keeps depends on its own logits only, not on how a sort orders
    ties, nor on the batch."""
    neg_inf = float("-inf")
    if args.top_k is not None:
        # the k-th largest logit of each row, from a (B, k_max) top-k rather than a full sort
        kth = x.topk(args.top_k_max, dim=-1).values.gather(1, (args.top_k - 1).clamp_(min=0))
        kth.masked_fill_(args.top_k == 0, neg_inf)  # rows without top-k keep everything
        x.masked_fill_(x < kth, neg_inf)
    if args.top_p is not None:
        values = x.sort(dim=-1, descending=True).values  # (B, V); the indices are not needed
        cdf = (values - values[:, :1]).exp_().cumsum_(dim=-1)
        # keep the best tokens while the mass before them is at most top_p: the last one kept
        # is the first whose cumulative mass passes top_p * total
        last = torch.searchsorted(cdf, args.top_p * cdf[:, -1:], right=True)
        cut = values.gather(1, last.clamp_(max=x.shape[-1] - 1))
        cut.masked_fill_(args.top_p >= 1.0, neg_inf)  # rows without top-p
        x.masked_fill_(x < cut, neg_inf)
