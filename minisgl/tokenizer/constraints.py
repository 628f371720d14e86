"""A request's constraint, compiled before it can start: the grammar-compile processes
(minisgl/grammar/pool.py) as the tokenizer worker uses them.

Contract: `Constraints(compiler, max_bytes)`; `start(msg, ids, observer)` begins what must
compile before `msg` can start: every tool's parameters (so that a bad one is refused
whatever tool_choice is), then the constraint (`response_format`'s schema, or the grammar
of forced tool calls). It returns the request `Prepared` at once when nothing needs
compiling, when the same texts compiled before (compiled grammars and refusals are cached
by their text: clients send the same schema again and again, and one that crashed the
compiler must not crash it again), or when it is refused uncompiled: a schema or grammar
larger than `max_bytes` (--grammar-max-bytes), or a constraint followed by more choices
than GRAMMAR_BUDGET_FACTOR times that allows (each choice's matcher computes its own mask
over the vocabulary every step). Otherwise None: it compiles in a process, never on the
worker's loop, and `ready(observer)` returns it once its job is done, with its grammar or
an error naming the field (response_format or tools) that did not compile, crashed the
compiler or outran its time limit. `cancel(uid)` drops a job's answer; `len()` is how
many wait. `compiler` may be a function that makes the compiler when it is first needed
(offline: no compile process until a request is constrained); None: there is none, and a
constrained request is an internal error.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from minisgl.message import ErrorInfo, ErrorKind, TokenizeMsg
from minisgl.observe import RequestObserver

logger = logging.getLogger(__name__)

# compiled grammars (and refusals) kept, by the text they came from
COMPILE_CACHE_ENTRIES = 256
COMPILE_CACHE_BYTES = 32 << 20
# a request's constraint counts once per choice (n): n x its bytes may be this many times
# --grammar-max-bytes (16 choices of a 32 KiB schema by default)
GRAMMAR_BUDGET_FACTOR = 4


@dataclass
class Prepared:
    """A request ready to start (its prompt ids, and the grammar of its constraint if it has
    one), or refused (`error`). `reasoning_open`: its prompt leaves a reasoning model inside
    its think block."""

    msg: TokenizeMsg
    ids: list[int] = field(default_factory=list)
    grammar: str | None = None
    error: ErrorInfo | None = None
    reasoning_open: bool = False


@dataclass
class _Compiling:
    """A tokenized request waiting for its grammar-compile job."""

    msg: TokenizeMsg
    ids: list[int]
    job: tuple[tuple[str, str], ...]  # (kind, text) per item: the cache key
    fields: list[tuple[str, str]]  # per item: (param, how its errors begin)


class Constraints:
    def __init__(self, compiler=None, max_bytes: int = 1 << 17) -> None:
        self.compiler = None if callable(compiler) else compiler
        self._make_compiler = compiler if callable(compiler) else None
        self.max_bytes = max_bytes
        self.compiling: dict[int, _Compiling] = {}  # uid -> request waiting for its grammar
        # job -> (grammar, failed item, error): least recently used first
        self._compiled: OrderedDict[tuple, tuple[str | None, int | None, str | None]] = (
            OrderedDict()
        )
        self._compiled_bytes = 0

    def __len__(self) -> int:
        return len(self.compiling)

    def fds(self) -> list[int]:
        return self.compiler.fds() if self.compiler is not None else []

    def wait_ms(self, default: int) -> int:
        return self.compiler.wait_ms(default) if self.compiling else default

    def cancel(self, uid: int) -> bool:
        if self.compiling.pop(uid, None) is None:
            return False
        self.compiler.cancel(uid)
        return True

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

    def start(self, msg: TokenizeMsg, ids: list[int], observer: RequestObserver) -> Prepared | None:
        job = self._compile_job(msg)
        if job is None:
            return Prepared(msg, ids)
        fields, items = job
        if (error := self._check_size(msg, fields, items)) is not None:
            return Prepared(msg, error=error)
        waiting = _Compiling(msg, ids, tuple(items), fields)
        if waiting.job in self._compiled:  # compiled before: no process needed
            self._compiled.move_to_end(waiting.job)
            return self._done(waiting, *self._compiled[waiting.job], observer)
        if self.compiler is None and self._make_compiler is not None:
            self.compiler = self._make_compiler()
        if self.compiler is None:
            error = ErrorInfo(ErrorKind.INTERNAL, "this server has no grammar compiler")
            return Prepared(msg, error=error)
        self.compiling[msg.uid] = waiting
        self.compiler.submit(msg.uid, items)
        return None

    def ready(self, observer: RequestObserver) -> list[Prepared]:
        """The requests whose job is done (the compiler also collects here what else its
        processes said)."""
        if self.compiler is None:
            return []
        done = []
        for result in self.compiler.collect():
            waiting = self.compiling.pop(result.key, None)
            if waiting is None:
                continue  # aborted while it compiled
            verdict = (result.grammar, result.failed, result.error)
            self._remember(waiting.job, verdict)
            done.append(self._done(waiting, *verdict, observer))
        return done

    def _done(self, waiting: _Compiling, grammar, failed, error, observer) -> Prepared:
        uid = waiting.msg.uid
        if error is None:
            observer.event(uid, "compiled")
            return Prepared(waiting.msg, waiting.ids, grammar)
        param, where = waiting.fields[failed]
        if not where and not error.startswith("not a usable"):  # a crash or a time limit
            where = "could not be compiled: "  # (the field is the error's param)
        logger.info("uid %d: %s%s", uid, where, error)
        info = ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, where + error, param)
        return Prepared(waiting.msg, error=info)

    @staticmethod
    def _compile_job(msg: TokenizeMsg):
        """What must compile before `msg` can start: every tool's parameters (so that a bad
        one is refused whatever tool_choice is), then the constraint; with, per item, the
        field its errors name. None when nothing needs compiling."""
        params = msg.sampling_params
        fields: list[tuple[str, str]] = []
        items: list[tuple[str, str]] = []
        for i, tool in enumerate(msg.tools or []):
            function = tool["function"]
            fields.append(("tools", f"tools[{i}] ({function['name']}): parameters: "))
            items.append(
                ("json_schema", json.dumps(function.get("parameters") or {"type": "object"}))
            )
        if params.json_schema is not None:  # response_format
            fields.append(("response_format", ""))
            items.append(("json_schema", params.json_schema))
        elif params.grammar is not None:  # built from the tools
            fields.append(("tools", ""))
            items.append(("lark", params.grammar))
        return (fields, items) if items else None

    def _check_size(self, msg, fields, items) -> ErrorInfo | None:
        """Schemas and grammars larger than --grammar-max-bytes are refused uncompiled, and
        so is a constraint followed by more choices than GRAMMAR_BUDGET_FACTOR times that
        allows: each choice's matcher computes its own mask over the vocabulary every step."""
        limit = self.max_bytes
        for (param, where), (kind, text) in zip(fields, items):
            size = len(text.encode())
            what = "JSON schema" if kind == "json_schema" else "grammar of the tools"
            prefix = where
            if size > limit:
                message = (
                    f"{prefix}the {what} is {size} bytes; this server compiles at most "
                    f"{limit} (--grammar-max-bytes)"
                )
                return ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, param)
        n = msg.sampling_params.n
        constraint = msg.sampling_params.json_schema or msg.sampling_params.grammar
        budget = GRAMMAR_BUDGET_FACTOR * limit
        if constraint is not None and n * len(constraint.encode()) > budget:
            param, where = fields[-1]
            message = (
                f"{where}{n} choices each following {len(constraint.encode())} "
                f"bytes of constraint is more than this server follows at once ({budget} "
                f"bytes of constraint times choices: {GRAMMAR_BUDGET_FACTOR} x "
                "--grammar-max-bytes); ask for fewer choices (n) or a smaller schema"
            )
            return ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, message, param)
        return None

    def _remember(self, job: tuple, verdict: tuple) -> None:
        size = sum(len(text) for _, text in job) + len(verdict[0] or verdict[2] or "")
        self._compiled[job] = verdict
        self._compiled_bytes += size
        while self._compiled and (
            len(self._compiled) > COMPILE_CACHE_ENTRIES
            or self._compiled_bytes > COMPILE_CACHE_BYTES
        ):
            old, (grammar, _, error) = self._compiled.popitem(last=False)
            self._compiled_bytes -= sum(len(t) for _, t in old) + len(grammar or error or "")
