"""Grammar-constrained decoding in the scheduler: a matcher per sequence, one mask per step.

Contract: a request whose output is constrained (`SamplingParams.json_schema`: response_format;
`SamplingParams.grammar`: forced tool calls) reaches the scheduler with its grammar already
compiled and checked by a grammar-compile process (minisgl/grammar/): `UserMsg.grammar`,
llguidance's grammar text. `Grammars(model_dir, vocab_size)` holds the model's token table
(built on a thread of its own: at once after `warm()`, the server's start-up) and builds
matchers on that thread too: `build(grammar)` returns a future of a fresh matcher, so a
large grammar never stalls the step loop; the scheduler admits the request once it is
ready. `copy(matcher)` is a fresh matcher's twin for another choice of the same request.
`mask(logits, rows, staging)` sets to -inf, in place, every token each row's matcher does
not allow next: one bitmask for all the constrained rows, filled by llguidance in native
code (no Python over the vocabulary), applied in one op. After a token is sampled the
scheduler feeds it to the sequence's matcher (`advance`). Once a matcher has seen a
complete value it allows only the end-of-sequence token, so a constrained sequence ends
with `finish_reason` "stop" like any other.

A matcher is state of its sequence (`Req.matcher`): it lives and dies with it, survives
preemption (tokens already sampled are never sampled again), and is counted in
/debug/lifecycle. Its mask for a step needs the previous token, so a constrained sequence
is never scheduled while its last token is still pending (overlap scheduling).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from minisgl.grammar import GrammarError, TokenTable
from minisgl.utils.staging import Staging

__all__ = ["GrammarError", "Grammars", "advance", "mask"]


class Grammars:
    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        # llguidance releases the GIL while it builds: the step loop runs on meanwhile
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._table: Future | None = None

    def warm(self) -> Future:
        """Start building the token table now (the server's start-up), not on the first
        constrained request."""
        return self._token_table()

    def _token_table(self) -> Future:
        if self._table is None:
            self._table = self._thread.submit(self._build_table)
        return self._table

    def _build_table(self):
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        except Exception as e:  # a bare config (--dummy-weights): no tokenizer, no grammar
            raise GrammarError(f"this model's output cannot be constrained: {e}") from None
        return TokenTable.of(hf, self.vocab_size).build()

    def build(self, grammar: str) -> Future:
        """A future of a new matcher for compiled `grammar` (it raises GrammarError)."""
        table = self._token_table()
        return self._thread.submit(_new_matcher, table, grammar)

    @staticmethod
    def copy(matcher):
        """A twin of a matcher that has consumed nothing (another choice's)."""
        return matcher.deep_copy()

    @staticmethod
    def advance(matcher, token: int, finished: bool) -> str | None:
        """`advance` below: the scheduling policy's way to feed a sequence's matcher."""
        return advance(matcher, token, finished)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _new_matcher(table: Future, grammar: str):
    import llguidance

    # silent: a matcher that gives up is reported by the scheduler, for its request
    matcher = llguidance.LLMatcher(table.result(), grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"not a usable grammar: {matcher.get_error()}")
    return matcher


_BITS = {}  # device -> arange(32): the bit of each token within its bitmask word


def mask(logits: torch.Tensor, rows: list[tuple[int, object]], staging: Staging) -> None:
    """Edit the (B, V) logits in place: each (row, matcher)'s disallowed tokens to -inf."""
    V = logits.shape[-1]
    words = -(-V // 32)  # 32 tokens per int32 of the bitmask
    host = staging.host(len(rows) * words, torch.int32)
    row_bytes = words * 4
    for j, (_, matcher) in enumerate(rows):  # llguidance writes each row's words in place
        matcher.unsafe_compute_mask_ptr(host.ctypes.data + j * row_bytes, row_bytes)
    bitmask = staging.copy(host).view(len(rows), words, 1)  # (R, W, 1)
    index = staging.to_device([row for row, _ in rows], torch.int64)
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    # token 32 * w + b is allowed when bit b of word w is set: (R, W, 32) -> (R, V)
    allowed = ((bitmask >> bits) & 1).view(len(rows), words * 32)[:, :V].bool()
    constrained = logits[index]  # a copy: the rows with a grammar
    constrained.masked_fill_(~allowed, float("-inf"))
    logits[index] = constrained


def advance(matcher, token: int, finished: bool) -> str | None:
    """Feed a sampled token to a sequence's matcher (the mask allowed nothing else). Returns
    why the output cannot satisfy its constraint, if it cannot: the grammar library gave up
    (it has limits, such as the items in one parser row a schema of hundreds of optional
    properties exceeds), or the sequence `finished` on a stop token before the value was
    complete. None: all is well."""
    if not matcher.is_stopped():
        matcher.consume_token(token)
    if matcher.is_error():
        return matcher.get_error().splitlines()[0]
    if finished and not matcher.is_accepting():
        return "the output ended before the value it constrains was complete"
    return None
