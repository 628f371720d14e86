"""Grammar-constrained decoding: grammars compiled with llguidance, a matcher per sequence.

Contract: a request's output is constrained by `SamplingParams.json_schema` (a JSON schema:
response_format) or `SamplingParams.grammar` (a grammar in llguidance's Lark syntax, which
can embed JSON schemas: forced tool calls). `compile_grammar(params)` turns either into an
llguidance grammar or raises `GrammarError` saying what is wrong; it needs no tokenizer, so
the tokenizer worker checks a request with it before the scheduler sees it.
`Grammars(model_dir, vocab_size)` reads the tokenizer's token table once, on the first
grammar it sees; `matcher(params)` returns a fresh matcher for a request's constraint
(compiled grammars are cached by their text), or None for free text. `mask(logits, rows, staging)`
sets to -inf, in place, every token each row's matcher does not allow next: one bitmask for
all the constrained rows, filled by llguidance in native code (no Python over the
vocabulary), applied in one op. After a token is sampled the scheduler feeds it to the
sequence's matcher (`advance`). Once a matcher has seen a complete value it allows only
the end-of-sequence token, so a constrained sequence ends with `finish_reason` "stop"
like any other.

A matcher is state of its sequence (`Req.matcher`): it lives and dies with it, survives
preemption (tokens already sampled are never sampled again), and is counted in
/debug/lifecycle. Its mask for a step needs the previous token, so a constrained sequence
is never scheduled while its last token is still pending (overlap scheduling).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from minisgl.core import SamplingParams

from .staging import Staging


class GrammarError(ValueError):
    pass


class Grammars:
    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._tokenizer = None  # llguidance's view of the model's tokenizer
        self._compiled: dict[str, str] = {}  # schema text -> its grammar

    def _token_table(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(self.model_dir))
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, params: SamplingParams):
        """A new matcher for `params`' constraint; None when the output is free text."""
        import llguidance

        key = params.json_schema or params.grammar
        if key is None:
            return None
        grammar = self._compiled.get(key)
        if grammar is None:
            grammar = self._compiled[key] = compile_grammar(params)
        matcher = llguidance.LLMatcher(self._token_table(), grammar)
        if matcher.is_error():
            raise GrammarError(f"not a usable grammar: {matcher.get_error()}")
        return matcher


def compile_grammar(params: SamplingParams) -> str | None:
    """The llguidance grammar of `params`' constraint (None: free text), or GrammarError."""
    if params.json_schema is not None:
        return compile_schema(params.json_schema)
    if params.grammar is not None:
        return _checked(_lark(params.grammar), "grammar")
    return None


@functools.lru_cache(maxsize=256)
def _lark(text: str) -> str:
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_lark(text)
    except Exception as e:
        raise GrammarError(f"not a usable grammar: {e}") from None


def _checked(grammar: str, what: str) -> str:
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"not a usable {what}: {problem}")
    return grammar


@functools.lru_cache(maxsize=256)  # a client sends the same schema again and again
def compile_schema(schema: str) -> str:
    """`schema` (JSON text) as an llguidance grammar, or GrammarError. Needs no tokenizer:
    the tokenizer worker checks a request's schema with it before the scheduler sees it.
    Whitespace between tokens is compact unless the schema's "x-guidance" says otherwise
    (a small model left free to add whitespace can add it until max_tokens)."""
    import json

    import llguidance

    try:
        parsed = json.loads(schema)
    except ValueError as e:
        raise GrammarError(f"not a usable JSON schema: not JSON ({e})") from None
    if isinstance(parsed, dict) and "x-guidance" not in parsed:
        parsed = {**parsed, "x-guidance": {"whitespace_flexible": False}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(parsed))
    except Exception as e:  # not a schema at all
        raise GrammarError(f"not a usable JSON schema: {e}") from None
    return _checked(grammar, "JSON schema")


def mask(logits: torch.Tensor, rows: list[tuple[int, object]], staging: Staging) -> None:
    """Edit the (B, V) logits in place: each (row, matcher)'s disallowed tokens to -inf."""
    import llguidance.torch as lt

    index = staging.to_device([row for row, _ in rows], torch.int64)
    words = -(-logits.shape[-1] // 32)  # 32 tokens per int32 of the bitmask
    host = staging.host(len(rows) * words, torch.int32)
    bitmask = torch.from_numpy(host).view(len(rows), words)
    for j, (_, matcher) in enumerate(rows):
        lt.fill_next_token_bitmask(matcher, bitmask, j)
    constrained = logits[index]  # a copy: the rows with a grammar
    lt.apply_token_bitmask_inplace(constrained, staging.copy(host).view(len(rows), words))
    logits[index] = constrained


def advance(matcher, token: int) -> None:
    """Feed a sampled token to a sequence's matcher (the mask allowed nothing else)."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
