"""DetokenizeManager: the scheduler's sampled tokens become what the client receives, one
`UserReply` per token: incremental, UTF-8-safe text with stop strings matched across token
boundaries, running token counts, and the logprobs' and prompt logprobs' token texts.

Contract: `add(uid, ...)` creates a request's decode state (one per choice); this happens
when its prompt is tokenized, never on a first token, so a late token for a uid that was
removed finds no state and is dropped (its reply is None). `feed(msgs)` turns tokens of
many requests into their replies, in order, one batched tokenizer call per round for the
text (and one for the token texts of the logprobs); a batch may hold several steps of one
uid (a worker that fell behind), which are then decoded in successive rounds, in order.
The reply that ends a request's last choice has `finished` set. `feed` also returns the
positions of the messages whose choice a stop string ended: the scheduler is still running
those, and the caller stops them there. `remove(uid)` drops the state; `feed` drops it
itself once every choice of the request has finished.

Why text is held back:
- one character can span several byte-level tokens (Chinese, emoji). Decoding a prefix of
  those tokens yields U+FFFD, so new text that ends in U+FFFD waits for the next token, but
  only while it can still become a character: held bytes that never can (a byte no UTF-8
  character has there) go out at once as U+FFFD, and only the tokens holding the start of a
  character the next ones may complete wait, so a few bytes at most are held and each step
  stays linear however long a model emits bytes that never complete.
  Decoding only from a recent offset keeps each step O(new tokens), and decoding a few
  tokens before the offset keeps tokenizers that merge spaces across token boundaries
  (SentencePiece-style) correct.
- text that could be the start of a stop string waits until it is known not to be one.
  A stop string ends its choice with finish_reason "stop" and is trimmed from the output.
A token's logprob goes out with its text, so that the logprobs' bytes spell the content: it
is held back while its text is, and dropped when its text never comes (an end token, a
character never completed).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass, field

from minisgl.message import DetokenizeMsg, TokenInfo, UserReply

from .stop import StopStrings
from .tokenize import token_bytes

_REPLACEMENT = "\ufffd"
_WINDOW = 8  # tokens of context for a token's text (text_offsets)


def _decode_begun(data: bytes) -> tuple[str, int]:
    """`data` as UTF-8 (U+FFFD for broken bytes), and how many bytes at its end begin a
    character that more bytes could complete."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return decoder.decode(data, final=False), len(decoder.getstate()[0])


@dataclass
class ChoiceState:
    ids: list[int] = field(default_factory=list)  # output token ids decoded to text
    tokens: int = 0  # output tokens received, an end token (whose text is not shown) too
    sent: int = 0  # characters of output text sent so far
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] is already-decoded context
    read_offset: int = 0  # ids before this have been turned into text
    # decoded text not yet sent, in pieces, while it could be the start of a stop string
    held: list[str] = field(default_factory=list)
    held_len: int = 0
    stop_state: list[int] = field(default_factory=list)  # StopStrings' matching state
    # logprobs of tokens whose text is held back: they go out with it, or not at all
    held_logprobs: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    echo: str = ""  # the prompt, sent ahead of the first token's text (completions' echo)
    started: bool = False  # its first message has been decoded


@dataclass
class DecodeState:
    prompt_tokens: int = 0
    choices: list[ChoiceState] = field(default_factory=lambda: [ChoiceState()])
    stop: StopStrings | None = None
    min_tokens: int = 0
    cached_tokens: int = 0
    # prompt logprobs, when asked: the prompt's ids until the scheduler's scores come, then
    # their TokenInfos, sent ahead of each choice's first output
    prompt_ids: list[int] | None = None
    prompt_infos: list[TokenInfo] | None = None

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class DetokenizeManager:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode_map: dict[int, DecodeState] = {}

    def add(
        self,
        uid: int,
        prompt_tokens: int = 0,
        n: int = 1,
        stop: list[str] | tuple[str, ...] = (),
        min_tokens: int = 0,
        echo: str = "",
        prompt_ids: list[int] | None = None,
    ) -> None:
        """`prompt_ids`: kept when the request asked for prompt logprobs."""
        stops = StopStrings(tuple(stop)) if stop else None
        choices = [
            ChoiceState(echo=echo, stop_state=stops.state() if stops else []) for _ in range(n)
        ]
        state = DecodeState(prompt_tokens, choices, stops, min_tokens, prompt_ids=prompt_ids)
        self.decode_map[uid] = state

    def remove(self, uid: int) -> None:
        self.decode_map.pop(uid, None)

    def _decode(self, batch: list[list[int]], skip_special: bool = True) -> list[str]:
        """The text of each list of ids: the output's text skips special tokens; the echoed
        prompt's (`skip_special=False`) keeps them."""
        if self.tokenizer is None:  # a model that takes token ids only: no text to show
            return [""] * len(batch)
        # the Rust tokenizer's own batch decode: transformers' wrapper around it costs about
        # ten times as much per call, and this runs twice per step for every request
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode_batch(batch, skip_special_tokens=skip_special)
        return self.tokenizer.batch_decode(
            batch, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        )

    def feed(self, msgs: list[DetokenizeMsg]) -> tuple[list[UserReply | None], set[int]]:
        """The reply to each message, in order (None for a token nobody waits for: its
        request or choice has ended), and the positions of those whose choice a stop string
        ended (the scheduler does not know yet)."""
        for msg in msgs:
            if msg.prompt_logprobs is not None:
                self._prompt_infos(msg)
        out: list[UserReply | None] = [None] * len(msgs)
        stopped: set[int] = set()
        pending = list(enumerate(msgs))
        while pending:  # each round holds at most one token per (uid, choice)
            seen: set[tuple[int, int]] = set()
            this_round, pending_next = [], []
            for item in pending:
                key = (item[1].uid, item[1].index)
                (pending_next if key in seen else this_round).append(item)
                seen.add(key)
            self._feed_round(this_round, out, stopped)
            pending = pending_next
        return out, stopped

    def _feed_round(
        self, items: list[tuple[int, DetokenizeMsg]], out: list, stopped: set[int]
    ) -> None:
        live: list[tuple[int, DecodeState, ChoiceState, DetokenizeMsg]] = []
        for i, msg in items:
            state = self.decode_map.get(msg.uid)
            if state is None or msg.index >= len(state.choices):
                continue
            choice = state.choices[msg.index]
            if choice.finish_reason is not None:
                continue  # stopped by a stop string; the scheduler had not heard yet
            state.cached_tokens = max(state.cached_tokens, msg.cached_tokens)
            # an end token (EOS or a stop_token_id: finish_reason "stop" from the scheduler)
            # ends the text; like a stop string, it is not part of it. No token at all: the
            # choice ended with its prompt (max_tokens 0)
            if msg.next_token is not None:
                choice.tokens += 1
                if msg.finish_reason != "stop":
                    choice.ids.append(msg.next_token)
            live.append((i, state, choice, msg))
        before = self._decode([c.ids[c.prefix_offset : c.read_offset] for _, _, c, _ in live])
        after = self._decode([c.ids[c.prefix_offset :] for _, _, c, _ in live])
        sampled = self._sampled_texts([msg for *_, msg in live])

        for (i, state, choice, msg), old, new in zip(live, before, after, strict=True):
            delta = new[len(old) :]
            last = msg.finish_reason is not None
            if delta and not delta.endswith(_REPLACEMENT):
                choice.prefix_offset, choice.read_offset = choice.read_offset, len(choice.ids)
            elif last:
                delta = delta.rstrip(_REPLACEMENT)  # bytes that never completed a character
            elif delta and (upto := self._complete_upto(choice)) > choice.read_offset:
                if upto < len(choice.ids):  # the tokens holding a character's start wait
                    delta = self._decode([choice.ids[choice.prefix_offset : upto]])[0][len(old) :]
                choice.prefix_offset, choice.read_offset = choice.read_offset, upto
            else:
                delta = ""
            text, stop_hit = self._apply_stop(state, choice, delta, last)
            echo, choice.echo = choice.echo, ""  # the prompt goes out ahead of the first text
            first, choice.started = not choice.started, True
            if stop_hit:
                choice.finish_reason = "stop"
                stopped.add(i)
            elif last:
                choice.finish_reason = msg.finish_reason
            start = choice.sent + len(echo)  # where this token's own text can start
            text = echo + text
            out[i] = UserReply(
                msg.uid,
                text,
                finished=state.done,
                finish_reason=choice.finish_reason,
                prompt_tokens=state.prompt_tokens,
                completion_tokens=choice.tokens,
                index=msg.index,
                logprobs=self._logprobs(choice, msg, text, start, sampled),
                cached_tokens=state.cached_tokens,
                prompt_logprobs=state.prompt_infos if first else None,
            )
            choice.sent += len(text)
            if state.done:
                self.remove(msg.uid)

    def _complete_upto(self, choice: ChoiceState) -> int:
        """How many of the choice's tokens may be turned into text now, their text ending in
        U+FFFD: none of those not yet turned when their bytes are characters and then the
        start of one more (the next tokens may complete it); else up to the last token
        boundary before that start that cuts no character (the bytes before it never
        become one: they go out, as U+FFFD where broken)."""
        pieces = token_bytes(self.tokenizer, choice.ids[choice.read_offset :])
        held = b"".join(pieces)
        decided, begun = _decode_begun(held)
        if not begun:
            return len(choice.ids)
        if _REPLACEMENT not in decided:
            return choice.read_offset
        boundary = len(held)
        for kept in range(1, len(pieces)):
            boundary -= len(pieces[-kept])
            head = held[:boundary].decode(errors="replace")
            if (
                boundary <= len(held) - begun
                and head + _decode_begun(held[boundary:])[0] == decided
            ):
                return len(choice.ids) - kept  # no character straddles this boundary
        return choice.read_offset

    # ------------------------------------------------------------------ logprobs
    def _texts(self, ids: list[int]) -> tuple[list[str], list[bytes]]:
        """Each token's own text and bytes, for logprobs (one batched decode)."""
        if self.tokenizer is None:  # token ids only: no text for them
            return [""] * len(ids), [b""] * len(ids)
        texts = self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)
        return texts, token_bytes(self.tokenizer, ids)

    def _sampled_texts(self, msgs: list[DetokenizeMsg]) -> Iterator[tuple[str, bytes]]:
        """The text and bytes of each sampled token that carries a logprob, then of its
        alternatives, in the order of `msgs`: decoded in one batched call."""
        ids: list[int] = []
        for msg in msgs:
            if msg.logprob is not None:
                ids.append(msg.next_token)
                ids += [token for token, _ in msg.logprob.top]
        return zip(*self._texts(ids)) if ids else iter(())

    @staticmethod
    def _logprobs(
        choice: ChoiceState, msg: DetokenizeMsg, text: str, start: int, sampled: Iterator
    ) -> list[TokenInfo] | None:
        """The logprobs that go out with a reply of `text`: those of earlier tokens held back
        with their text, then this token's, whose own text ends `text` (a token still held
        back starts where the output is now). None while the text is held back, and for
        good when it never comes (an end token, a character never completed)."""
        lp = msg.logprob
        if lp is None:
            return None
        token, raw = next(sampled)
        top = [(*next(sampled), value) for _, value in lp.top]
        offset = start
        if token and text.endswith(token):
            offset = choice.sent + len(text) - len(token)
        info = TokenInfo(token, raw, lp.logprob, offset, top)
        held = choice.held_logprobs
        if text:
            choice.held_logprobs = []
            return [*held, info]
        if choice.finish_reason is None:
            held.append(info)
        return None

    def _prompt_infos(self, msg: DetokenizeMsg) -> None:
        """The scheduler's prompt logprobs as TokenInfos on the request's decode state, to go
        ahead of each choice's first output; the first prompt token has no logprob."""
        state = self.decode_map.get(msg.uid)
        if state is None or state.prompt_ids is None:
            return  # aborted meanwhile
        ids, state.prompt_ids = state.prompt_ids, None
        alternatives = [token for lp in msg.prompt_logprobs for token, _ in lp.top]
        texts, raws = self._texts(ids + alternatives)
        offsets = self.text_offsets(ids, state.choices[0].echo)
        infos = [TokenInfo(texts[0], raws[0], None, 0)]
        alt = len(ids)  # where the next position's alternatives are in texts/raws
        for i, lp in enumerate(msg.prompt_logprobs, 1):
            top = [(texts[alt + j], raws[alt + j], v) for j, (_, v) in enumerate(lp.top)]
            alt += len(top)
            infos.append(TokenInfo(texts[i], raws[i], lp.logprob, offsets[i], top))
        state.prompt_infos = infos

    def text_offsets(self, ids: list[int], text: str = "") -> list[int]:
        """Where each token's text starts in `text`, the prompt as echoed (by default: `ids`
        decoded with their special tokens, which the echo keeps, as OpenAI and vLLM echo a
        prompt): token i starts where the text of ids[:i] ends. Two batched decodes over a
        window of WINDOW tokens before each one, which is context enough for a character
        split over tokens (4 bytes at most) and for tokenizers that merge spaces across
        tokens; a token that only begins a character is where it starts. A text prompt is
        echoed as sent: tokens the tokenizer added ahead of it (a BOS) are at 0, and no
        offset points past its end."""
        spans = [ids[max(0, i - _WINDOW) : i] for i in range(len(ids))]
        before = self._decode(spans, skip_special=False)
        upto = self._decode([span + [t] for span, t in zip(spans, ids)], skip_special=False)
        offsets, pos = [], 0
        for old, new in zip(before, upto):
            offsets.append(pos)
            pos += max(0, len(new) - len(old))
        if not text:
            return offsets
        whole = self._decode([ids], skip_special=False)[0]
        added = len(whole) - len(text) if whole != text and whole.endswith(text) else 0
        return [min(max(0, offset - added), len(text)) for offset in offsets]

    # --8<-- [start:stop_strings]
    @staticmethod
    def _apply_stop(
        state: DecodeState, choice: ChoiceState, delta: str, last: bool
    ) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop string ended the choice."""
        stops = state.stop
        if stops is None:
            return delta, False
        hit = stops.scan(choice.stop_state, delta, armed=choice.tokens >= state.min_tokens)
        before = choice.held_len  # held characters ahead of `delta`
        total = before + len(delta)
        keep = StopStrings.held(choice.stop_state)  # could still begin a stop string
        if hit is None and not last and keep == total:
            choice.held.append(delta)  # all of it waits: nothing to join, nothing to send
            choice.held_len = total
            return "", False
        text = "".join(choice.held) + delta  # each character is joined once, on its way out
        choice.held, choice.held_len = [], 0
        if hit is not None:  # the stop string and all after it never reach the client
            end, length = hit
            return text[: before + end - length], True
        if last:
            return text, False
        choice.held, choice.held_len = [text[total - keep :]], keep
        return text[: total - keep], False

    # --8<-- [end:stop_strings]
