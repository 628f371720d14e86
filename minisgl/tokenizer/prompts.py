"""A prompt's tokens: built on the tokenizer worker's loop when small, on a thread of their
own when large, and never at all when the text cannot fit the context.

Contract: `Prompts(tokenizer, max_seq_len, escape_special)`; `tokenize(msg)` is the prompt's
token ids, an `ErrorInfo` (the prompt cannot be tokenized, or holds more bytes of text than
`max_seq_len` of the model's longest tokens could: refused untokenized), or None: a prompt
whose template input costs more than TOKENIZE_INLINE_BYTES is rendered and tokenized on the
prompt thread, and `ready()` returns it, as (msg, ids or error), in the order the prompts
came, once done; a pipe (`fds()`) wakes the process loop then. Every byte that reaches the
chat template counts, not only the messages' contents: tool calls' arguments, tool
definitions (descriptions, parameters), names; and each message costs MESSAGE_BYTES more,
since the template renders each one (118,181 empty messages are seconds of rendering).
`cancel(uid)` forgets a prompt sent to the thread: one not started there never runs, and
the tokens of one under way are dropped when they come; `len()` is how many are there. A
prompt given as token ids is taken as it is.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg, unpack_ids

from .tokenize import ToolsUnsupported, build_prompt_ids, longest_token_bytes

logger = logging.getLogger(__name__)

# prompts whose template input costs more than this are tokenized on a thread of their own
TOKENIZE_INLINE_BYTES = 32 << 10
# what rendering one message costs beyond its text, in bytes of text (the template's own
# markup per message, about that many bytes for the usual templates)
MESSAGE_BYTES = 32


class Prompts:
    def __init__(
        self, tokenizer, max_seq_len: int | None = None, escape_special: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.escape_special = escape_special  # messages' text as plain text (no control tokens)
        # a prompt longer than this many bytes of text cannot fit the context whatever its
        # tokens (None: no bound known, or no tokenizer: a model folder with a config alone
        # takes token ids only)
        self.max_seq_len = max_seq_len
        bounded = bool(max_seq_len) and tokenizer is not None
        self.longest_token_bytes = longest_token_bytes(tokenizer) if bounded else 1
        self.max_prompt_bytes = max_seq_len * self.longest_token_bytes if bounded else None
        self.waiting: dict[int, tuple[TokenizeMsg, Future]] = {}  # on the thread, in order
        self.thread: ThreadPoolExecutor | None = None
        self._wake_read = self._wake_write = -1

    def __len__(self) -> int:
        return len(self.waiting)

    def fds(self) -> list[int]:
        return [self._wake_read] if self.thread is not None else []

    def tokenize(self, msg: TokenizeMsg) -> list[int] | ErrorInfo | None:
        if msg.input_ids_packed is not None:
            return unpack_ids(msg.input_ids_packed)
        size = _text_bytes(msg)
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            return self._too_long(size)
        cost = size + MESSAGE_BYTES * len(msg.messages or ())
        if cost > TOKENIZE_INLINE_BYTES:  # seconds of work for a few MB: not on the loop
            self._tokenize_later(msg)
            return None
        try:
            return self._build(msg)
        except Exception as exc:
            return _cannot_tokenize(msg, exc)

    def ready(self) -> list[tuple[TokenizeMsg, list[int] | ErrorInfo]]:
        """The large prompts whose tokens are ready, in the order they came."""
        if not self.waiting:
            return []
        try:
            os.read(self._wake_read, 1 << 16)
        except BlockingIOError:
            pass
        done: list[tuple[TokenizeMsg, list[int] | ErrorInfo]] = []
        for uid, (msg, future) in list(self.waiting.items()):
            if not future.done():
                break  # one thread, first come first served: the rest are not done either
            del self.waiting[uid]
            try:
                done.append((msg, future.result()))
            except Exception as exc:
                done.append((msg, _cannot_tokenize(msg, exc)))
        return done

    def cancel(self, uid: int) -> bool:
        waiting = self.waiting.pop(uid, None)
        if waiting is None:
            return False
        waiting[1].cancel()  # not started: it never runs (under way: its tokens are dropped)
        return True

    def _build(self, msg: TokenizeMsg) -> list[int]:
        prompt = msg.messages if msg.messages is not None else msg.text or ""
        return build_prompt_ids(
            self.tokenizer,
            prompt,
            msg.tools,
            msg.add_generation_prompt,
            msg.continue_final_message,
            msg.chat_template_kwargs,
            escape_special=self.escape_special,
        )

    def _too_long(self, size: int) -> ErrorInfo:
        at_least = -(-size // self.longest_token_bytes)
        return ErrorInfo(
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {size} bytes of text, so at least {at_least} tokens (no token of "
            f"this model is longer than {self.longest_token_bytes} bytes), but this server's "
            f"context is {self.max_seq_len} tokens; shorten the prompt",
        )

    def _tokenize_later(self, msg: TokenizeMsg) -> None:
        if self.thread is None:
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
            self._wake_read, self._wake_write = os.pipe()
            os.set_blocking(self._wake_read, False)
        future = self.thread.submit(self._build, msg)
        future.add_done_callback(lambda _: os.write(self._wake_write, b"!"))
        self.waiting[msg.uid] = (msg, future)


def _text_bytes(msg: TokenizeMsg) -> int:
    """Bytes of text that reach the chat template, at least: every string value of the
    messages (contents, names, tool calls' names and arguments) and of the tool
    definitions, whose keys a template writes out too (as JSON): what bounds how few tokens
    the prompt can become, and what rendering it costs."""
    if msg.messages is None:
        return len((msg.text or "").encode())
    size, stack = 0, [(msg.messages, False), (msg.tools or [], True)]
    while stack:  # no recursion: the values are as deep as a request made them
        value, keys = stack.pop()
        if isinstance(value, str):
            size += len(value.encode())
        elif isinstance(value, dict):
            stack.extend((k, keys) for k in value if keys)
            stack.extend((v, keys) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, keys) for v in value)
    return size


def _cannot_tokenize(msg: TokenizeMsg, exc: Exception) -> ErrorInfo:
    if isinstance(exc, ToolsUnsupported):
        return ErrorInfo(ErrorKind.INVALID_PROMPT, str(exc), "tools")
    # a template or tokenizer error is the request's, not ours
    logger.info("uid %d: cannot tokenize: %s", msg.uid, exc)
    return ErrorInfo(ErrorKind.INVALID_PROMPT, f"cannot tokenize the prompt: {exc}")
