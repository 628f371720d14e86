"""Batched sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Contract: `Sampler.prepare(reqs)` turns the sequences that sample this step into tensors
once; `Sampler.sample(logits, args)` picks one token per row with tensor ops only (no Python
loop over requests, no host sync): logits processors first (logits.py), then greedy or
temperature / top-k / top-p sampling. `Sampler.logprobs` reports, for the rows that asked,
the sampled token's log-probability and the top alternatives, from the model's raw
distribution (before processors and temperature, as vLLM reports them by default).

Randomness is counter-based: the noise for request r at output index s over token v is a
hash of (seed_r, s, v). A request therefore draws the same tokens for the same seed whatever
else shares its batch, and again after being preempted and recomputed. Sampling uses the
Gumbel-max trick: argmax(logits / T + Gumbel noise) draws from softmax(logits / T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.message import TokenLogprob

from .logits import LogitsProcessors

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


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) float32 in (0, 1), a pure function of (seed, step, token id)."""
    seed_lo, seed_hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(seed_lo ^ _mix32(seed_hi ^ 0x5BD1E995))
    key = _mix32(key ^ _mix32((steps & _M32) ^ 0x27D4EB2F))  # (B,)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32((key[:, None] + _mul32(ids, 0x9E3779B1)[None, :]) & _M32)
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _as_int64(seed: int) -> int:
    """Any Python int -> the signed 64-bit value with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class SamplingArgs:
    greedy_only: bool
    processors: LogitsProcessors | None = None
    logprob_rows: list[tuple[int, int]] | None = None  # (row, alternatives) asking logprobs
    temperature: torch.Tensor | None = None  # (B, 1) float32, 1.0 on greedy rows
    greedy: torch.Tensor | None = None  # (B,) bool
    top_k: torch.Tensor | None = None  # (B, 1) int64, vocab when disabled
    top_p: torch.Tensor | None = None  # (B, 1) float32
    seeds: torch.Tensor | None = None  # (B,) int64
    steps: torch.Tensor | None = None  # (B,) int64: output index being sampled


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, reqs: list[Req]) -> SamplingArgs:
        params = [r.sampling_params for r in reqs]
        processors = LogitsProcessors.prepare(reqs, self.vocab_size, self.device)
        logprob_rows = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        if all(p.is_greedy for p in params):
            return SamplingArgs(True, processors, logprob_rows or None)
        greedy = [p.is_greedy for p in params]
        args = SamplingArgs(
            greedy_only=False,
            processors=processors,
            logprob_rows=logprob_rows or None,
            temperature=self._tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32
            )[:, None],
            greedy=self._tensor(greedy, torch.bool),
            seeds=self._tensor([_as_int64(r.seed) for r in reqs], torch.int64),
            steps=self._tensor([r.output_len for r in reqs], torch.int64),
        )
        if any(0 < p.top_k < self.vocab_size for p in params):
            ks = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
            args.top_k = self._tensor(ks, torch.int64)[:, None]
        if any(p.top_p < 1.0 for p in params):
            args.top_p = self._tensor([p.top_p for p in params], torch.float32)[:, None]
        return args

    def sample(self, logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """logits: (B, V) float32 -> (B,) int64 token ids."""
        if args.processors is not None:
            logits = args.processors.apply(logits.clone())
        greedy_tokens = logits.argmax(dim=-1)
        if args.greedy_only:
            return greedy_tokens
        logits = logits / args.temperature
        noise = uniform_noise(args.seeds, args.steps, logits.shape[-1])
        if args.top_k is not None or args.top_p is not None:
            logits = self._filter_top_k_top_p(logits, args)
        gumbel = -torch.log(-torch.log(noise))
        sampled = (logits + gumbel).argmax(dim=-1)
        return torch.where(args.greedy, greedy_tokens, sampled)

    @staticmethod
    def _filter_top_k_top_p(logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """Set to -inf every logit outside each row's top-k and top-p nucleus."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if args.top_k is not None:
            drop |= ranks >= args.top_k
        if args.top_p is not None:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before > args.top_p  # the top token always stays: its mass_before is 0
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def logprobs(
        raw_logits: torch.Tensor, tokens: torch.Tensor, args: SamplingArgs
    ) -> list[TokenLogprob | None] | None:
        """Per row: the sampled token's logprob and its top alternatives, or None."""
        if args.logprob_rows is None:
            return None
        rows = torch.tensor([r for r, _ in args.logprob_rows], device=raw_logits.device)
        logp = raw_logits[rows].log_softmax(dim=-1)  # (R, V)
        chosen = logp.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
        k_max = max(k for _, k in args.logprob_rows)
        top_v, top_i = logp.topk(k_max, dim=-1) if k_max else (logp[:, :0], logp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out: list[TokenLogprob | None] = [None] * raw_logits.shape[0]
        for j, (row, k) in enumerate(args.logprob_rows):
            out[row] = TokenLogprob(chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        return out
