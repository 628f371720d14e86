"""What happens to a prompt between its TokenizeMsg and its UserMsg: the tokenizer worker's
extension, behind the interface the worker calls.

Contract: `Preparation(tokenizer, compiler, grammar_max_bytes, max_seq_len, escape_special,
strict_max_tokens)`.
`submit(msg, observer)` starts preparing one request and returns those it finished at
once; `ready(observer)` returns those finished since (large prompts tokenized on their
thread: prompts.py; constraints compiled in their processes: constraints.py), in order.
Each is `Prepared`: its prompt ids and the grammar of its constraint, or an error that
refuses it. The observer hears the prompt tokenized (`received`, with its token count) and
the constraint compiled. `cancel(uid)` forgets a request still being prepared (True if it
was); `state()` counts them; `fds()` and `wait_ms(default)` tell the process loop what
wakes it and how long it may wait. A prompt that leaves a reasoning model inside its think
block (`msg.reasoning`, the --reasoning-parser) is marked `reasoning_open`.

With `strict_max_tokens` (the HTTP server), a prompt that fits the context (`max_seq_len`)
but leaves less room than its `max_tokens` asks for is refused once tokenized
(CONTEXT_LENGTH_EXCEEDED, naming `max_tokens`), as the servers of vLLM, SGLang and OpenAI
refuse it: the prompt plus max_tokens must fit; max_tokens left out means "up to the
context". Without it (the offline `LLM`, like vLLM's), the scheduler (Policy.add) cuts
max_tokens to the room left, which it also does as the server's backstop where the KV pool
holds less than one context (the scheduler's context is then smaller than the model's,
which is all the server's tokenizer worker knows).
"""

from __future__ import annotations

from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg
from minisgl.observe import RequestObserver

from .constraints import Constraints, Prepared
from .prompts import Prompts
from .tokenize import reasoning_open


class Preparation:
    def __init__(
        self,
        tokenizer,
        compiler=None,
        grammar_max_bytes: int = 1 << 17,
        max_seq_len: int | None = None,
        escape_special: bool = False,
        strict_max_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # the context max_tokens is checked against (None: not checked, the scheduler cuts)
        self.max_tokens_context = max_seq_len if strict_max_tokens else None
        self.prompts = Prompts(tokenizer, max_seq_len, escape_special)
        self.constraints = Constraints(compiler, grammar_max_bytes)

    def submit(self, msg: TokenizeMsg, observer: RequestObserver) -> list[Prepared]:
        tokens = self.prompts.tokenize(msg)
        return [] if tokens is None else self._tokenized(msg, tokens, observer)

    def ready(self, observer: RequestObserver) -> list[Prepared]:
        done = []
        for msg, tokens in self.prompts.ready():
            done += self._tokenized(msg, tokens, observer)
        return done + [self._finished(p) for p in self.constraints.ready(observer)]

    def cancel(self, uid: int) -> bool:
        return self.prompts.cancel(uid) or self.constraints.cancel(uid)

    def state(self) -> dict[str, int]:
        return {"tokenizing": len(self.prompts), "grammar_compiles": len(self.constraints)}

    def fds(self) -> list[int]:
        return self.constraints.fds() + self.prompts.fds()

    def wait_ms(self, default: int) -> int:
        return self.constraints.wait_ms(default)

    def close(self) -> None:
        self.constraints.close()

    def _tokenized(
        self, msg: TokenizeMsg, tokens: list[int] | ErrorInfo, observer: RequestObserver
    ) -> list[Prepared]:
        if isinstance(tokens, ErrorInfo):
            return [Prepared(msg, error=tokens)]
        observer.received(msg.uid, prompt_tokens=len(tokens))
        if (error := self._no_room(len(tokens), msg.sampling_params.max_tokens)) is not None:
            return [Prepared(msg, error=error)]
        prepared = self.constraints.start(msg, tokens, observer)
        return [] if prepared is None else [self._finished(prepared)]

    def _no_room(self, prompt_tokens: int, max_tokens: int | None) -> ErrorInfo | None:
        """Why `max_tokens` cannot follow a prompt of `prompt_tokens` in the context, if it
        cannot (a prompt that fills the context alone is the scheduler's to refuse)."""
        context = self.max_tokens_context
        if context is None or max_tokens is None or prompt_tokens >= context:
            return None
        room = context - prompt_tokens
        if max_tokens <= room:
            return None
        return ErrorInfo(
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            f"{max_tokens} output tokens were asked for, but this server's context is "
            f"{context} tokens and the prompt has {prompt_tokens}, so at most {room} can "
            "follow it; ask for at most that many, or leave the limit out to generate up to "
            "the context",
            "max_tokens",
        )

    def _finished(self, prepared: Prepared) -> Prepared:
        msg = prepared.msg
        if prepared.error is None and msg.reasoning is not None:
            prepared.reasoning_open = reasoning_open(self.tokenizer, prepared.ids, msg.reasoning)
        return prepared
