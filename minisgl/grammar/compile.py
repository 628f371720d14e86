"""One grammar compile: a user's constraint turned into llguidance's grammar, checked.

Contract: `compile_item(kind, text, tokenizer)` takes one constraint, kind "json_schema"
(a JSON schema as JSON text: response_format, a tool's parameters) or "lark" (a grammar
in llguidance's Lark syntax, which can embed JSON schemas: forced tool calls), and returns
llguidance's grammar text for it, or raises `GrammarError` saying what is wrong. Given the
token table (`TokenTable.build()`), it also builds the matcher the scheduler will build
from that text and computes its first mask: every piece of native work the scheduler will
do for this grammar has then run once, here. That is why it runs in a compile process
(pool.py): llguidance is native code, and a schema that crashes or stalls it must cost
that process, not the server.

Whitespace between JSON tokens is compact unless the schema's "x-guidance" says otherwise
(a small model left free to add whitespace can add it until max_tokens).
No torch here: a compile process starts in a fraction of a second.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec

KINDS = ("json_schema", "lark")


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says why (it goes to the client)."""


class TokenTable(msgspec.Struct, frozen=True):
    """What llguidance needs to know about a model's tokenizer, in a form that crosses
    process boundaries: the fast tokenizer serialised as JSON (added tokens included), the
    model's vocabulary size (its logits may be wider than the tokenizer) and the EOS id.
    The scheduler and the compile processes build their tables from the same value."""

    tokenizer_json: str
    n_vocab: int
    eos_token: int | None = None

    @classmethod
    def of(cls, hf_tokenizer: Any, n_vocab: int) -> TokenTable:
        backend = copy.copy(hf_tokenizer.backend_tokenizer)  # the settings below stay on the copy
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), n_vocab, hf_tokenizer.eos_token_id)

    def build(self):
        """llguidance's token table (about a second for a 150k vocabulary)."""
        import llguidance

        return llguidance.LLTokenizer(
            self.tokenizer_json, n_vocab=self.n_vocab, eos_token=self.eos_token
        )


def compile_item(kind: str, text: str, tokenizer=None) -> str:
    """llguidance's grammar for one constraint, checked (against `tokenizer`, llguidance's
    token table, when given); GrammarError when it cannot constrain decoding."""
    import llguidance

    if kind == "json_schema":
        grammar, what = _from_schema(text), "JSON schema"
    elif kind == "lark":
        try:
            grammar, what = llguidance.LLMatcher.grammar_from_lark(text), "grammar"
        except Exception as e:
            raise GrammarError(f"not a usable grammar: {e}") from None
    else:
        raise GrammarError(f"unknown kind of constraint {kind!r}; expected one of {KINDS}")
    if tokenizer is None:
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    else:  # what the scheduler will do with it: build the matcher, compute a mask
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if not matcher.is_error():
            matcher.compute_bitmask()
        problem = matcher.get_error() if matcher.is_error() else ""
    if problem:
        raise GrammarError(f"not a usable {what}: {problem}")
    return grammar


def _from_schema(text: str) -> str:
    import llguidance

    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"not a usable JSON schema: not JSON ({e})") from None
    if isinstance(parsed, dict) and "x-guidance" not in parsed:
        parsed = {**parsed, "x-guidance": {"whitespace_flexible": False}}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(parsed))
    except Exception as e:  # not a schema at all
        raise GrammarError(f"not a usable JSON schema: {e}") from None
