"""DetokenizeManager: incremental, UTF-8-safe text for each request's sampled tokens.

Contract: `add(uid)` creates a request's decode state; this happens when its prompt is
tokenized, never on a first token, so a late token for a uid that was removed finds no state
and is dropped (`feed` returns None for it). `feed(msgs)` turns tokens of many requests into
their new text, one batched tokenizer call per round; a batch may hold several steps of one
uid (a worker that fell behind), which are then decoded in successive rounds, in order.
`remove(uid)` drops the state; `feed` drops it itself when a message carries a
finish_reason.

Why text is held back: one character can span several byte-level tokens (Chinese, emoji).
Decoding a prefix of those tokens yields U+FFFD, so new text that ends in U+FFFD waits for
the next token. Decoding only from a recent offset keeps each step O(new tokens), and
decoding a few tokens before the offset keeps tokenizers that merge spaces across token
boundaries (SentencePiece-style) correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.message import DetokenizeMsg

_REPLACEMENT = "\ufffd"


@dataclass
class Decoded:
    text: str  # new text for this token (may be empty while a character is incomplete)
    prompt_tokens: int
    completion_tokens: int  # output tokens so far, this one included


@dataclass
class DecodeState:
    prompt_tokens: int = 0
    ids: list[int] = field(default_factory=list)  # output token ids so far
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] is already-sent context
    read_offset: int = 0  # ids before this have been turned into sent text


class DetokenizeManager:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode_map: dict[int, DecodeState] = {}

    def add(self, uid: int, prompt_tokens: int = 0) -> None:
        self.decode_map[uid] = DecodeState(prompt_tokens)

    def remove(self, uid: int) -> None:
        self.decode_map.pop(uid, None)

    def _decode(self, batch: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(
            batch, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def feed(self, msgs: list[DetokenizeMsg]) -> list[Decoded | None]:
        """New text and counts per message, in order; None for a uid without decode state."""
        out: list[Decoded | None] = [None] * len(msgs)
        pending = list(enumerate(msgs))
        while pending:  # each round holds at most one token per uid
            seen: set[int] = set()
            this_round, pending_next = [], []
            for item in pending:
                (pending_next if item[1].uid in seen else this_round).append(item)
                seen.add(item[1].uid)
            self._feed_round(this_round, out)
            pending = pending_next
        return out

    def _feed_round(
        self, items: list[tuple[int, DetokenizeMsg]], out: list[Decoded | None]
    ) -> None:
        live: list[tuple[int, DecodeState, DetokenizeMsg]] = []
        for i, msg in items:
            if (state := self.decode_map.get(msg.uid)) is not None:
                state.ids.append(msg.next_token)
                live.append((i, state, msg))
        before = self._decode([s.ids[s.prefix_offset : s.read_offset] for _, s, _ in live])
        after = self._decode([s.ids[s.prefix_offset :] for _, s, _ in live])

        for (i, state, msg), old, new in zip(live, before, after, strict=True):
            delta = new[len(old) :]
            finished = msg.finish_reason is not None
            if delta and not delta.endswith(_REPLACEMENT):
                state.prefix_offset, state.read_offset = state.read_offset, len(state.ids)
            elif finished:
                delta = delta.rstrip(_REPLACEMENT)  # bytes that never completed a character
            else:
                delta = ""
            out[i] = Decoded(delta, state.prompt_tokens, len(state.ids))
            if finished:
                self.remove(msg.uid)
