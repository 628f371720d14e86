"""Grammar-constrained decoding: JSON schemas compiled with llguidance, a matcher per sequence.

Contract: `Grammars(model_dir, vocab_size)` reads the tokenizer's token table once, on the
first schema it sees. `matcher(schema)` compiles `schema` (a JSON schema, as JSON text;
compiled grammars are cached by that text) and returns a fresh matcher, or raises
`GrammarError` saying what is wrong with the schema. `mask(logits, rows, staging)`
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

from pathlib import Path

import torch

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

    def matcher(self, schema: str):
        """A new matcher for output that is one JSON value valid against `schema`."""
        import llguidance

        grammar = self._compiled.get(schema)
        if grammar is None:
            grammar = self._compiled[schema] = compile_schema(schema)
        matcher = llguidance.LLMatcher(self._token_table(), grammar)
        if matcher.is_error():
            raise GrammarError(f"not a usable JSON schema: {matcher.get_error()}")
        return matcher


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
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"not a usable JSON schema: {problem}")
    return grammar


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
