"""Core data of the engine: sampling parameters, one request's state, one forward batch.

Contract:
- `SamplingParams` is what a user may ask for per request; it travels inside messages.
- `Req` is the scheduler's record of one sequence being generated: one choice of one
  request (a request with `n` choices has n of them, all with the request's uid). It owns
  the token ids (prompt followed by outputs) and knows how far the KV cache has caught up
  (`cached_len`). It never touches devices: pages and table slots are handed to it by the
  managers.
- `ReqStatus` is where a sequence is in its life; the scheduler's policy sets it at every
  transition (scheduler/policy.py), and whether a sequence is alive, and which manager
  holds it, is read from it (`Req.ended`), never inferred from its other fields:
      BUILDING -> WAITING            its grammar's matcher is built (constrained only)
      WAITING | PREEMPTED -> PREFILLING -> RUNNING   prefill chunks, then decoding
      RUNNING -> PREEMPTED           evicted for recompute (back to the prefill manager)
      PREFILLING -> WAITING          gave its pages back to running sequences
      any -> FINISHED | ABORTED      a finish reason; an abort, a stop string, an error
  WAITING, PREFILLING and PREEMPTED sequences are in the prefill manager, RUNNING ones in
  the decode manager, BUILDING ones in neither (they hold nothing yet).
- `Batch` is one forward step: the sequences in it and how many new tokens each adds.

A sequence advances like this (T = seq_len, every token known so far):
    prefill chunk:  tokens [cached_len, cached_len + extend_len) run through the model
    at launch:      cached_len += extend_len; if cached_len == T the step samples a token,
                    which is *pending* (num_pending = 1: on the device, not yet in
                    token_ids) until the step's results are read; T counts it already
    at results:     the token is appended to token_ids (num_pending back to 0)
    decode:         extend_len == 1, the one token not yet in the cache (maybe pending:
                    then the step reads it from the device, see engine/inputs.py)
With overlap scheduling the next step is scheduled while a token is still pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, Literal

from minisgl.rules import rule, rules_of

FinishReason = Literal["stop", "length"]

MAX_N = 16  # choices per request
# sequences one /v1/completions request may ask for (prompts x n): each is decoded apart
MAX_SEQUENCES = 1024
MAX_STOP = 4  # stop strings per request, as in OpenAI's API
MAX_STOP_LEN = 1000  # characters per stop string: what may be held back per choice
MAX_LOGPROBS = 20  # alternatives per token
MAX_LOGIT_BIAS = 300  # token ids one request may bias, as in OpenAI's API
# far more than any model's special tokens; a list a request may send is never unbounded
MAX_STOP_TOKEN_IDS = 1024


# bounds of what the wire format (msgpack, int32 token arrays) and the engine's int64
# tensors carry: anything larger is refused where the request enters, never an overflow
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy.

    Each field declares its rule once, here (`minisgl.rules.rule`: meaning and bounds);
    `validate()` checks them and the relations between fields. Both entrances check before
    anything is queued: the HTTP request models take their field constraints and messages
    from these rules (server/protocol.py), `LLM.generate` calls `validate()`. The scheduler
    checks only what needs the model (vocabulary, context length).

    Under a constraint (`json_schema` or `grammar`) the grammar decides where the output
    ends (the end-of-sequence token is allowed only once the value is complete), so stop
    strings, stop_token_ids and min_tokens, which would cut the value short or hold its end
    off, are dropped: the output always parses."""

    # 2 is OpenAI's cap: past it the distribution is all but uniform noise
    temperature: float = rule(
        "0: greedy; higher flattens the distribution", default=0.0, ge=0.0, le=2.0
    )
    # vLLM's meaning: -1 and 0 both turn the filter off (clients send either)
    top_k: int = rule("keep the k likeliest tokens; -1 or 0: off", default=-1, ge=-1, le=INT32_MAX)
    top_p: float = rule(
        "keep the likeliest tokens whose probabilities sum to top_p", default=1.0, gt=0.0, le=1.0
    )
    # 0: nothing is generated; the prompt is only prefilled (and scored)
    max_tokens: int | None = rule(
        "most tokens to generate; None: as many as the context allows",
        default=None,
        ge=0,
        le=INT64_MAX,
    )
    min_tokens: int = rule(
        "end-of-sequence and stop tokens/strings are held off until then",
        default=0,
        ge=0,
        le=INT32_MAX,
    )
    ignore_eos: bool = rule("generate past the end-of-sequence token", default=False)
    # a seed is reduced to 64 bits; one past what a 64-bit integer holds is refused
    seed: int | None = rule(
        "makes sampling reproducible; None: a fresh random seed per request",
        default=None,
        ge=-(2**63),
        le=2**64 - 1,
    )
    n: int = rule("choices sampled from one prompt, prefilled once", default=1, ge=1, le=MAX_N)
    stop: list[str] = rule(
        "stop strings (matched on text), as in OpenAI's API",
        default_factory=list,
        max_items=MAX_STOP,
        min_length=1,
        max_length=MAX_STOP_LEN,
    )
    stop_token_ids: list[int] = rule(
        "tokens that end the output",
        default_factory=list,
        ge=0,
        le=INT32_MAX,
        max_items=MAX_STOP_TOKEN_IDS,
    )
    presence_penalty: float = rule(
        "subtracted once from tokens already generated", default=0.0, ge=-2.0, le=2.0
    )
    frequency_penalty: float = rule(
        "subtracted per occurrence in the generated tokens", default=0.0, ge=-2.0, le=2.0
    )
    repetition_penalty: float = rule(
        "divides (or multiplies) logits of seen tokens; 1: off", default=1.0, gt=0.0, le=2.0
    )
    logit_bias: dict[int, float] = rule(
        "added to the logits of these token ids",
        default_factory=dict,
        ge=-100.0,
        le=100.0,
        max_items=MAX_LOGIT_BIAS,
    )
    logprobs: int | None = rule(
        "None: none; k: the sampled token's logprob and k alternatives",
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
    )
    # computed in the prefill (completions' echo + logprobs)
    prompt_logprobs: int | None = rule(
        "None: none; k: each prompt token's logprob given the tokens before it (the "
        "first has none) and k alternatives",
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
    )
    json_schema: str | None = rule(
        "the output is one JSON value valid against this JSON schema (JSON text)", default=None
    )
    # forced tool calls use it
    grammar: str | None = rule(
        "or: the output follows this grammar, in llguidance's Lark syntax", default=None
    )
    # not sampling, but per request all the same (vLLM's `cache_salt`)
    cache_salt: str | None = rule(
        "requests share cached prefix pages only when their salts are equal; None is "
        "the salt of the unsalted",
        default=None,
        min_length=1,
        max_length=256,
    )

    def __post_init__(self) -> None:
        if self.json_schema is not None or self.grammar is not None:
            self.stop, self.stop_token_ids, self.min_tokens = [], [], 0

    @property
    def is_greedy(self) -> bool:
        # below 1e-5 a temperature only overflows float32 logits: it means "greedy"
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    # --8<-- [start:sampling_validate]
    def validate(self) -> tuple[str, str] | None:
        """Return (parameter, message) for a value no request may carry, else None: each
        field's rule, then the relations between fields."""
        for name, field_rule in SAMPLING_RULES.items():
            if (message := field_rule.problem(name, getattr(self, name))) is not None:
                return name, message
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return "min_tokens", f"min_tokens must not exceed max_tokens, got {self.min_tokens!r}"
        if self.json_schema is not None and self.grammar is not None:
            return "grammar", "give json_schema or grammar, not both"
        return None

    # --8<-- [end:sampling_validate]


SAMPLING_RULES = rules_of(SamplingParams)


@dataclass
class PromptScores:
    """The prompt logprobs of a sequence while it is prefilled. Position p scores prompt
    token p + 1 (given tokens 0..p), so positions 0..prompt_len - 2 are scored, chunk by
    chunk, in the steps that compute them. `launched`: positions a launched step scores
    (moved at launch, like cached_len, so a recomputed chunk never scores one twice);
    `values`: one TokenLogprob per position, as the steps' results are read."""

    launched: int = 0
    values: list[Any] = field(default_factory=list)


class ReqStatus(Enum):
    """Where a sequence is in its life (see the module docstring for the transitions)."""

    BUILDING = "building"  # constrained: its grammar's matcher is being built
    WAITING = "waiting"  # in the prefill manager, nothing of it computed for this admission
    PREFILLING = "prefilling"  # in the prefill manager, partly prefilled
    RUNNING = "running"  # in the decode manager: its prompt is cached, it decodes
    PREEMPTED = "preempted"  # evicted from running for recompute: back in the prefill manager
    FINISHED = "finished"  # ended with a finish reason
    ABORTED = "aborted"  # ended by an abort, a stop string or an error


_ENDED = frozenset({ReqStatus.FINISHED, ReqStatus.ABORTED})


@dataclass(eq=False)
class Req:
    """One sequence (one choice of one request) as the scheduler sees it."""

    uid: int
    token_ids: list[int]  # prompt followed by every sampled token
    prompt_len: int
    max_len: int  # prompt_len + max_tokens after clamping to the context
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    index: int = 0  # which choice of its request
    client: str = ""  # who sent the request: prefill takes turns between clients
    forks_left: int = 0  # choices still to be forked off once the prompt is cached
    table_idx: int = -1  # slot in the page table; -1 while it holds none
    cached_len: int = 0  # tokens whose K/V are in the cache
    extend_len: int = 0  # tokens this step feeds to the model (set by the managers)
    num_pending: int = 0  # sampled tokens not yet in token_ids (0 or 1)
    pages: list[int] = field(default_factory=list)  # KV pages held, in order (maybe shared)
    # prompt tokens found in the prefix cache when it was prefilled, until they are
    # reported with its first token
    cached_tokens: int = 0
    matcher: Any = None  # grammar state (engine/grammar.py) when the output is constrained
    # prompt logprobs being computed (asked for and not yet sent with the first reply)
    prompt_scores: PromptScores | None = None
    reported_len: int = 0  # output tokens already counted in a timeline's decode events
    finish_reason: FinishReason | None = None
    status: ReqStatus = ReqStatus.WAITING

    @property
    def ended(self) -> bool:
        """Finished or aborted: a launched step's token for it is dropped."""
        return self.status in _ENDED

    @property
    def key(self) -> tuple[int, int]:
        return self.uid, self.index

    @property
    def seq_len(self) -> int:
        """Tokens so far, the pending one included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_len(self) -> int:
        """Tokens sampled so far, the pending one included (the index of the next one)."""
        return self.seq_len - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        """The sampled tokens known on the host (not a pending one)."""
        return self.token_ids[self.prompt_len :]

    @property
    def uncached_len(self) -> int:
        return self.seq_len - self.cached_len

    @property
    def scores_prompt(self) -> bool:
        """Prompt positions are still to be scored: a cached prefix would skip them (a
        cached page holds K/V, not logits), so such a sequence takes none."""
        s = self.prompt_scores
        return s is not None and s.launched < self.prompt_len - 1

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """Tokens that end the sequence (once min_tokens are out)."""
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy, with nothing that edits its logits (bias, min_tokens, penalties) and no
        logprobs: sampling it is a bare argmax."""
        p = self.sampling_params
        return (
            p.is_greedy
            and not p.logit_bias
            and p.min_tokens == 0
            and not p.has_penalties
            and p.logprobs is None
            and self.matcher is None
        )

    def append_token(self, token: int) -> None:
        """Record a sampled token (pending until now, if it was) and decide whether the
        sequence has finished."""
        ids = self.token_ids
        ids.append(token)
        if self.num_pending:
            self.num_pending -= 1
        # runs for every token of every sequence: the cheap test first, properties inlined
        if token in self.stop_token_set and (
            len(ids) + self.num_pending - self.prompt_len >= self.sampling_params.min_tokens
        ):
            self.finish_reason = "stop"
        elif len(ids) >= self.max_len:
            self.finish_reason = "length"

    def __repr__(self) -> str:
        return (
            f"Req(uid={self.uid}, index={self.index}, seq_len={self.seq_len}, "
            f"cached_len={self.cached_len}, table_idx={self.table_idx}, pages={len(self.pages)})"
        )


class Batch:
    """One forward step. `reqs` each carry their `extend_len` for this step; what the step
    does for each is read once, when the batch is made (before `cached_len` moves). The
    caller may say that the first `decodes` requests are decodes (one token each, which
    always samples): the scheduler knows, and that saves a pass over them every step."""

    __slots__ = ("reqs", "decodes", "is_decode", "sampling_rows", "sampling_reqs", "scoring")

    def __init__(self, reqs: list[Req], decodes: int = 0) -> None:
        self.reqs, self.decodes = reqs, decodes
        rest = reqs[decodes:]
        self.is_decode = all(r.extend_len == 1 for r in rest)
        # indices into reqs of the sequences that sample: their step ends where their known
        # tokens (the pending one included) end, and they may still grow (max_tokens 0
        # only prefills)
        self.sampling_rows = list(range(decodes)) + [
            i
            for i, r in enumerate(rest, decodes)
            if r.cached_len + r.extend_len == (n := len(r.token_ids) + r.num_pending)
            and n < r.max_len
        ]
        self.sampling_reqs = reqs[:decodes] + [reqs[i] for i in self.sampling_rows[decodes:]]
        # prompt logprobs this step computes: (index into reqs, first position, positions,
        # the first one's row in the step's tokens); see PromptScores
        self.scoring: list[tuple[int, int, int, int]] = []
        row = decodes
        for i, r in enumerate(rest, decodes):
            if r.prompt_scores is not None:
                start = max(r.cached_len, r.prompt_scores.launched)
                end = min(r.cached_len + r.extend_len, r.prompt_len - 1)
                if start < end:
                    self.scoring.append((i, start, end - start, row + start - r.cached_len))
            row += r.extend_len
