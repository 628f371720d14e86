"""The tokenizer worker process: text -> token ids on the way in, ids -> text on the way out.

Contract (per uid):
- TokenizeMsg: build the prompt ids, create the decode state, send UserMsg to the scheduler.
  A prompt that cannot be tokenized is answered at once with an error UserReply. A request
  with a constraint (response_format, forced tool calls) or tools first has them compiled
  by the grammar-compile processes (minisgl/grammar/pool.py), never on this loop: it waits
  here (counted as `grammar_compiles`) while other requests go on, then goes to the
  scheduler with its compiled grammar, or is answered with an error naming the field
  (response_format or tools) that did not compile, was too large, crashed the compiler or
  outran its time limit. Compiled grammars (and refusals) are cached by their text. A
  prompt that leaves a reasoning model inside its `<think>` block is told to the API
  server with a UserReply carrying `reasoning_open`, ahead of any output.
- AbortMsg: drop the decode state (or the wait for a compile) and forward AbortBackendMsg
  (the reference forwarded the abort but kept the decode state, which then leaked).
- DetokenizeMsg: the DetokenizeManager (detokenize.py) makes it the UserReply of that
  choice (new text, counts, logprobs), sent on as it is; when a stop string ends a choice,
  AbortBackendMsg(uid, index) stops it in the scheduler; the reply that ends the last
  choice is the request's terminal one and removes the decode state. A token for a uid
  without decode state (aborted) is dropped.
- BackendErrorMsg: drop the decode state, send the error on as the terminal UserReply.
- LifecycleQueryMsg: forwarded to the scheduler; its answer comes back as SchedulerStateMsg
  and goes to the API server together with this worker's own counts.
- Observers (minisgl/observe.py, added with `observe`) hear each request tokenized, its
  first output, a grammar compiled, a stop string and its end; any other message (the
  scheduler's observers' batches) is theirs to take, or is passed on to the API server.
Consecutive DetokenizeMsgs are decoded in one batched tokenizer call.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BackendErrorMsg,
    BackendMsg,
    DetokenizeMsg,
    ErrorInfo,
    ErrorKind,
    FrontendMsg,
    LifecycleQueryMsg,
    LifecycleStateMsg,
    SchedulerStateMsg,
    StateQueryMsg,
    TokenizeMsg,
    TokenizerMsg,
    UserMsg,
    UserReply,
    unpack_ids,
)
from minisgl.observe import Observers, RequestObserver

from .detokenize import DetokenizeManager
from .tokenize import (
    ToolsUnsupported,
    build_prompt_ids,
    longest_token_bytes,
    reasoning_open,
)

logger = logging.getLogger(__name__)

# compiled grammars (and refusals) kept, by the text they came from: clients send the same
# schema again and again, and one that crashed the compiler must not crash it again
COMPILE_CACHE_ENTRIES = 256
COMPILE_CACHE_BYTES = 32 << 20
# a request's constraint counts once per choice (n): n x its bytes may be this many times
# --grammar-max-bytes (16 choices of a 32 KiB schema by default)
GRAMMAR_BUDGET_FACTOR = 4
# prompts of more text than this are tokenized on a thread of their own (a MB takes seconds)
TOKENIZE_INLINE_BYTES = 32 << 10


def _text_bytes(msg: TokenizeMsg) -> int:
    """Bytes of text the prompt holds, at least (its messages' contents; tool calls and the
    template's own text not counted): what bounds how few tokens it can become."""
    if msg.messages is None:
        return len((msg.text or "").encode())
    size = 0
    for m in msg.messages:
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                size += len(text.encode())
    return size


@dataclass
class _Compiling:
    """A tokenized request waiting for its grammar-compile job."""

    msg: TokenizeMsg
    ids: list[int]
    job: tuple[tuple[str, str], ...]  # (kind, text) per item: the cache key
    fields: list[tuple[str, str]]  # per item: (param, how its errors begin)


class TokenizerWorker:
    def __init__(
        self,
        tokenizer,
        send_backend: Callable[[list[BackendMsg]], None],
        send_frontend: Callable[[list[FrontendMsg]], None],
        compiler=None,
        grammar_max_bytes: int = 1 << 17,
        max_seq_len: int | None = None,
        escape_special: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenize_manager = DetokenizeManager(tokenizer)
        self.send_backend = send_backend
        self.send_frontend = send_frontend
        self.observer = Observers()
        # grammar/pool.py's GrammarCompiler, or a function that makes one when it is first
        # needed (offline: no compile process until a request is constrained); None: none
        self.compiler = None if callable(compiler) else compiler
        self._make_compiler = compiler if callable(compiler) else None
        self.grammar_max_bytes = grammar_max_bytes
        self.escape_special = escape_special  # messages' text as plain text (no control tokens)
        self._compiling: dict[int, _Compiling] = {}  # uid -> request waiting for its grammar
        self._compiled: OrderedDict[tuple, tuple[str | None, int | None, str | None]] = (
            OrderedDict()
        )  # job -> (grammar, failed item, error): least recently used first
        self._compiled_bytes = 0
        # a prompt longer than this many bytes of text cannot fit the context whatever its
        # tokens: refused untokenized (None: no bound known, or no tokenizer: a model folder
        # with a config alone takes token ids only)
        self.max_seq_len = max_seq_len
        bounded = bool(max_seq_len) and tokenizer is not None
        self.longest_token_bytes = longest_token_bytes(tokenizer) if bounded else 1
        self.max_prompt_bytes = max_seq_len * self.longest_token_bytes if bounded else None
        self._tokenizing: dict[int, tuple[TokenizeMsg, Future]] = {}  # large prompts, FIFO
        self._prompt_thread: ThreadPoolExecutor | None = None
        self._wake_read = self._wake_write = -1

    def observe(self, observer: RequestObserver) -> None:
        self.observer.add(observer)

    def state(self) -> dict[str, int]:
        return {
            "decode_states": len(self.detokenize_manager.decode_map),
            "tokenizing": len(self._tokenizing),  # large prompts on the prompt thread
            "grammar_compiles": len(self._compiling),  # requests waiting for their grammar
        }

    def _preparing(self, uid: int) -> bool:
        return uid in self._tokenizing or uid in self._compiling

    def wait_ms(self, default: int) -> int:
        """How long the process loop may wait for messages before `handle([])` is due."""
        return self.compiler.wait_ms(default) if self._compiling else default

    def fds(self) -> list[int]:
        """File descriptors that wake the process loop: the compile processes' answers and
        the prompt thread's."""
        fds = self.compiler.fds() if self.compiler is not None else []
        return fds + [self._wake_read] if self._prompt_thread is not None else fds

    # --8<-- [start:handle]
    def handle(self, msgs: list[TokenizerMsg]) -> None:
        to_backend: list[BackendMsg] = []
        to_frontend: list[FrontendMsg] = []
        if self._tokenizing:  # large prompts tokenized since the last call go first
            to_backend += self._take_tokenized(to_frontend)
        if self.compiler is not None:  # then the grammars compiled (and what else they said)
            to_backend += self._take_compiled(to_frontend)
        run: list[DetokenizeMsg] = []  # consecutive tokens, decoded in one batch
        for msg in msgs:
            if isinstance(msg, DetokenizeMsg):
                run.append(msg)
                continue
            to_frontend += self._detokenize(run, to_backend)
            run = []
            if isinstance(msg, TokenizeMsg):
                to_backend += self._tokenize(msg, to_frontend)
            elif isinstance(msg, AbortMsg):
                uid = msg.uid
                if uid in self.detokenize_manager.decode_map or self._preparing(uid):
                    self.observer.ended(uid, "aborted")
                self.detokenize_manager.remove(uid)  # the decode state goes too
                self._tokenizing.pop(uid, None)  # its tokens are dropped when they come
                if self._compiling.pop(uid, None) is not None:
                    self.compiler.cancel(uid)
                to_backend.append(AbortBackendMsg(msg.uid))
            elif isinstance(msg, BackendErrorMsg):
                to_frontend += self._error(msg)
            elif isinstance(msg, LifecycleQueryMsg):
                to_backend.append(StateQueryMsg(msg.query_id, msg.flush_cache))
            elif isinstance(msg, SchedulerStateMsg):
                to_frontend.append(LifecycleStateMsg(msg.query_id, self.state(), msg.state))
            elif not self.observer.inbox(msg):  # the scheduler's observers': theirs, or on
                to_frontend.append(msg)
        to_frontend += self._detokenize(run, to_backend)
        to_frontend += self.observer.outbox()  # after the replies its events describe
        self.send_backend(to_backend)
        self.send_frontend(to_frontend)

    # --8<-- [end:handle]

    def _tokenize(self, msg: TokenizeMsg, to_frontend: list[FrontendMsg]) -> list[BackendMsg]:
        if msg.input_ids_packed is not None:
            return self._tokenized(msg, unpack_ids(msg.input_ids_packed), to_frontend)
        size = _text_bytes(msg)
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            return self._refuse(msg.uid, self._too_long(size), to_frontend)
        if size > TOKENIZE_INLINE_BYTES:  # seconds of work for a few MB: not on this loop
            self._tokenize_later(msg)
            return []
        try:
            ids = self._build(msg)
        except Exception as exc:
            return self._refuse(msg.uid, self._cannot_tokenize(msg, exc), to_frontend)
        return self._tokenized(msg, ids, to_frontend)

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

    @staticmethod
    def _cannot_tokenize(msg: TokenizeMsg, exc: Exception) -> ErrorInfo:
        if isinstance(exc, ToolsUnsupported):
            return ErrorInfo(ErrorKind.INVALID_PROMPT, str(exc), "tools")
        # a template or tokenizer error is the request's, not ours
        logger.info("uid %d: cannot tokenize: %s", msg.uid, exc)
        return ErrorInfo(ErrorKind.INVALID_PROMPT, f"cannot tokenize the prompt: {exc}")

    def _too_long(self, size: int) -> ErrorInfo:
        at_least = -(-size // self.longest_token_bytes)
        return ErrorInfo(
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {size} bytes of text, so at least {at_least} tokens (no token of "
            f"this model is longer than {self.longest_token_bytes} bytes), but this server's "
            f"context is {self.max_seq_len} tokens; shorten the prompt",
        )

    def _tokenize_later(self, msg: TokenizeMsg) -> None:
        """Tokenize on the prompt thread (the tokenizer releases the GIL); a pipe wakes the
        process loop when it is done."""
        if self._prompt_thread is None:
            self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
            self._wake_read, self._wake_write = os.pipe()
            os.set_blocking(self._wake_read, False)
        future = self._prompt_thread.submit(self._build, msg)
        future.add_done_callback(lambda _: os.write(self._wake_write, b"!"))
        self._tokenizing[msg.uid] = (msg, future)

    def _take_tokenized(self, to_frontend: list[FrontendMsg]) -> list[BackendMsg]:
        """Large prompts whose tokens are ready, in the order they came."""
        try:
            os.read(self._wake_read, 1 << 16)
        except BlockingIOError:
            pass
        to_backend: list[BackendMsg] = []
        for uid, (msg, future) in list(self._tokenizing.items()):
            if not future.done():
                break  # one thread, first come first served: the rest are not done either
            del self._tokenizing[uid]
            try:
                ids = future.result()
            except Exception as exc:
                to_backend += self._refuse(uid, self._cannot_tokenize(msg, exc), to_frontend)
                continue
            to_backend += self._tokenized(msg, ids, to_frontend)
        return to_backend

    def _tokenized(self, msg: TokenizeMsg, ids: list[int], to_frontend) -> list[BackendMsg]:
        """The prompt's tokens are known: compile its constraints, or send it on."""
        self.observer.received(msg.uid, prompt_tokens=len(ids))
        job = self._compile_job(msg)
        if job is None:
            return self._admit(msg, ids, to_frontend)
        fields, items = job
        if (error := self._check_size(msg, fields, items)) is not None:
            return self._refuse(msg.uid, error, to_frontend)
        waiting = _Compiling(msg, ids, tuple(items), fields)
        if waiting.job in self._compiled:  # compiled before: no process needed
            self._compiled.move_to_end(waiting.job)
            return self._compile_done(waiting, *self._compiled[waiting.job], to_frontend)
        if self.compiler is None and self._make_compiler is not None:
            self.compiler = self._make_compiler()
        if self.compiler is None:
            error = ErrorInfo(ErrorKind.INTERNAL, "this server has no grammar compiler")
            return self._refuse(msg.uid, error, to_frontend)
        self._compiling[msg.uid] = waiting
        self.compiler.submit(msg.uid, items)
        return []

    def _admit(
        self, msg: TokenizeMsg, ids: list[int], to_frontend: list, grammar: str | None = None
    ) -> list:
        """The request goes to the scheduler; its decode state is created here, with the
        prompt, never by a first token. A prompt that leaves a reasoning model inside its
        think block is told to the API server first."""
        params = msg.sampling_params
        echo = ""
        if msg.echo:
            echo = (
                msg.text
                if msg.text is not None
                else self.tokenizer.decode(ids, skip_special_tokens=True)
            )
        self.detokenize_manager.add(
            msg.uid,
            len(ids),
            params.n,
            params.stop,
            params.min_tokens,
            echo=echo,
            prompt_ids=ids if params.prompt_logprobs is not None else None,
        )
        if msg.reasoning is not None and reasoning_open(self.tokenizer, ids, msg.reasoning):
            to_frontend.append(UserReply(msg.uid, reasoning_open=True))
        return [UserMsg.make(msg.uid, ids, params, grammar)]

    def _refuse(self, uid: int, error: ErrorInfo, to_frontend: list[FrontendMsg]) -> list:
        """A request that cannot start: one error reply, no decode state, nothing sent on."""
        self.observer.ended(uid, "error", kind=error.kind.value)
        to_frontend.append(UserReply(uid, finished=True, error=error))
        return []

    # ------------------------------------------------------------------ grammars
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
        limit = self.grammar_max_bytes
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

    def _take_compiled(self, to_frontend: list[FrontendMsg]) -> list[BackendMsg]:
        to_backend: list[BackendMsg] = []
        for result in self.compiler.collect():
            waiting = self._compiling.pop(result.key, None)
            if waiting is None:
                continue  # aborted while it compiled
            verdict = (result.grammar, result.failed, result.error)
            self._remember(waiting.job, verdict)
            to_backend += self._compile_done(waiting, *verdict, to_frontend)
        return to_backend

    def _compile_done(self, waiting: _Compiling, grammar, failed, error, to_frontend) -> list:
        uid = waiting.msg.uid
        if error is None:
            self.observer.event(uid, "compiled")
            return self._admit(waiting.msg, waiting.ids, to_frontend, grammar)
        param, where = waiting.fields[failed]
        if not where and not error.startswith("not a usable"):  # a crash or a time limit
            where = "could not be compiled: "  # (the field is the error's param)
        logger.info("uid %d: %s%s", uid, where, error)
        info = ErrorInfo(ErrorKind.INVALID_SAMPLING_VALUE, where + error, param)
        return self._refuse(uid, info, to_frontend)

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

    def _detokenize(
        self, run: list[DetokenizeMsg], to_backend: list[BackendMsg]
    ) -> list[FrontendMsg]:
        """The replies to a run of tokens (decoded in one batch); a choice that a stop string
        ended is stopped in the scheduler."""
        if not run:
            return []
        replies: list[FrontendMsg] = []
        decoded, stopped = self.detokenize_manager.feed(run)
        for i, (msg, reply) in enumerate(zip(run, decoded)):
            if reply is None:
                continue  # late token of an aborted request or stopped choice: dropped
            if reply.completion_tokens == 1 and msg.index == 0:
                self.observer.first_output(msg.uid)
            if i in stopped:
                to_backend.append(AbortBackendMsg(msg.uid, msg.index))
                self.observer.event(msg.uid, "stop_string", index=msg.index)
            if reply.finished:
                self.observer.ended(msg.uid, "finished", reason=reply.finish_reason)
            replies.append(reply)
        return replies

    def _error(self, msg: BackendErrorMsg) -> list[FrontendMsg]:
        state = self.detokenize_manager.decode_map.get(msg.uid)
        if state is None:
            return []  # already aborted: the API server has forgotten this uid
        self.detokenize_manager.remove(msg.uid)
        self.observer.ended(msg.uid, "error", kind=msg.error.kind.value)
        generated = sum(c.tokens for c in state.choices)
        return [
            UserReply(
                msg.uid,
                finished=True,
                error=msg.error,
                prompt_tokens=state.prompt_tokens,
                completion_tokens=generated,
            )
        ]
