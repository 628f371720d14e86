"""What happens to a prompt between its TokenizeMsg and its UserMsg: the tokenizer worker's
extension, behind the interface the worker calls.

Contract: `Preparation(tokenizer, compiler, grammar_max_bytes, max_seq_len, escape_special)`.
`submit(msg, observer)` starts preparing one request and returns those it finished at
once; `ready(observer)` returns those finished since (large prompts tokenized on their
thread: prompts.py; constraints compiled in their processes: constraints.py), in order.
Each is `Prepared`: its prompt ids and the grammar of its constraint, or an error that
refuses it. The observer hears the prompt tokenized (`received`, with its token count) and
the constraint compiled. `cancel(uid)` forgets a request still being prepared (True if it
was); `state()` counts them; `fds()` and `wait_ms(default)` tell the process loop what
wakes it and how long it may wait. A prompt that leaves a reasoning model inside its think
block (`msg.reasoning`, the --reasoning-parser) is marked `reasoning_open`.
"""

from __future__ import annotations

from minisgl.message import ErrorInfo, TokenizeMsg
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
    ) -> None:
        self.tokenizer = tokenizer
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
        prepared = self.constraints.start(msg, tokens, observer)
        return [] if prepared is None else [self._finished(prepared)]

    def _finished(self, prepared: Prepared) -> Prepared:
        msg = prepared.msg
        if prepared.error is None and msg.reasoning is not None:
            prepared.reasoning_open = reasoning_open(self.tokenizer, prepared.ids, msg.reasoning)
        return prepared
