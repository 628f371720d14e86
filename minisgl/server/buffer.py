"""ReplyBuffer: the pending output of one request in the API server, coalesced.

Contract: the listener `append`s every UserReply of the request; the consumer `take`s
everything pending at once as one `Output` (the text of each choice joined, its logprobs,
the choices that ended since, the running token counts). However many replies arrive
between two wake-ups, the buffer holds one string's worth per choice, and `pending_bytes`
says how much memory the unread output holds (memory.py; the slow-client cap is checked
against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.message import ErrorInfo, TokenInfo, UserReply

from .memory import logprobs_bytes, text_bytes


@dataclass
class ChoiceOutput:
    index: int
    text: str
    finish_reason: str | None  # set on the output in which the choice ended
    logprobs: list[TokenInfo]


@dataclass
class Output:
    """Everything that was pending for one request at one wake-up."""

    choices: list[ChoiceOutput]  # only choices with news: text, logprobs or their end
    prompt_tokens: int
    completion_tokens: int  # all choices together
    finished: bool  # the request is over: every choice ended, or an error
    error: ErrorInfo | None
    # prompt tokens served from the prefix cache; None: not told (--hide-cached-tokens)
    cached_tokens: int | None = 0
    reasoning_open: bool = False  # the output starts inside a think block (reasoning.py)

    @property
    def text(self) -> str:
        """The new text of the first choice (all there is when n == 1)."""
        return "".join(c.text for c in self.choices if c.index == 0)

    @property
    def finish_reason(self) -> str | None:
        """How the first choice ended, on the output in which it did."""
        return next((c.finish_reason for c in self.choices if c.index == 0), None)

    @staticmethod
    def merge(outputs: list[Output], n: int) -> Output:
        """Several prompts of one request: choice i of prompt p becomes choice p * n + i."""
        choices = [
            ChoiceOutput(p * n + c.index, c.text, c.finish_reason, c.logprobs)
            for p, out in enumerate(outputs)
            for c in out.choices
        ]
        error = next((o.error for o in outputs if o.error is not None), None)
        return Output(
            choices,
            sum(o.prompt_tokens for o in outputs),
            sum(o.completion_tokens for o in outputs),
            error is not None or all(o.finished for o in outputs),
            error,
            None
            if any(o.cached_tokens is None for o in outputs)
            else sum(o.cached_tokens for o in outputs),
            any(o.reasoning_open for o in outputs),
        )


@dataclass
class _ChoiceBuffer:
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenInfo] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    finish_taken: bool = False


# --8<-- [start:reply_buffer]
@dataclass
class ReplyBuffer:
    """Pending output of one request, coalesced: many replies take one buffer's room."""

    n: int = 1
    choices: list[_ChoiceBuffer] = field(default_factory=list)
    pending_bytes: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # False (--hide-cached-tokens): the prefix cache's hits are not told, so that a client
    # cannot learn from them whether another sent the same prefix
    report_cached: bool = True
    finished: bool = False
    error: ErrorInfo | None = None
    reasoning_open: bool = False

    def __post_init__(self) -> None:
        self.choices = [_ChoiceBuffer() for _ in range(self.n)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def append(self, reply: UserReply) -> bool:
        """Add one reply; return whether the consumer has something new to take."""
        choice = self.choices[reply.index]
        text = reply.incremental_output
        if text:
            choice.pieces.append(text)
            self.pending_bytes += text_bytes(text)
        if reply.prompt_logprobs:
            # ahead of the output's: not counted against the slow-client cap, as their size
            # is the prompt's (the request's own), arriving once, not output piling up
            choice.logprobs += reply.prompt_logprobs
        if reply.logprobs:
            choice.logprobs += reply.logprobs
            # logprobs wait unread too: count them against the slow-client cap
            self.pending_bytes += logprobs_bytes(reply.logprobs)
        choice.tokens = max(choice.tokens, reply.completion_tokens)
        self.prompt_tokens = max(self.prompt_tokens, reply.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, reply.cached_tokens)
        self.reasoning_open = self.reasoning_open or reply.reasoning_open
        if reply.finish_reason is not None:
            choice.finish_reason = reply.finish_reason
        if reply.finished:
            self.finish(reply.error)
        news = text or reply.logprobs or reply.prompt_logprobs or reply.finish_reason
        return bool(news or reply.finished)

    def finish(self, error: ErrorInfo | None = None) -> None:
        self.finished, self.error = True, error

    def take(self) -> Output:
        news = []
        for index, c in enumerate(self.choices):
            ended = c.finish_reason is not None and not c.finish_taken
            if c.pieces or c.logprobs or ended:
                news.append(ChoiceOutput(index, "".join(c.pieces), c.finish_reason, c.logprobs))
                c.pieces, c.logprobs, c.finish_taken = [], [], c.finish_taken or ended
        self.pending_bytes = 0
        return Output(
            news,
            self.prompt_tokens,
            self.completion_tokens,
            self.finished,
            self.error,
            self.cached_tokens if self.report_cached else None,
            self.reasoning_open,
        )


# --8<-- [end:reply_buffer]
