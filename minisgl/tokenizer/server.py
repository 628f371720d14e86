"""The tokenizer worker process: text -> token ids on the way in, ids -> text on the way out.

Contract (per uid):
- TokenizeMsg: build the prompt ids, create the decode state, send UserMsg to the scheduler.
  A prompt that cannot be tokenized is answered at once with an error UserReply. A request
  with a constraint (response_format, forced tool calls) or tools first has them compiled
  by the grammar-compile processes (minisgl/grammar/pool.py), never on this loop: it waits
  here (counted as `grammar_compiles`) while other requests go on, then goes to the
  scheduler with its compiled grammar, or is answered with an error naming the field
  (response_format or tools) that did not compile, was too large, crashed the compiler or
  outran its time limit. Compiled grammars (and refusals) are cached by their text.
- AbortMsg: drop the decode state (or the wait for a compile) and forward AbortBackendMsg
  (the reference forwarded the abort but kept the decode state, which then leaked).
- DetokenizeMsg: new text for one choice of the uid, sent on as a UserReply; when a stop
  string ends a choice, AbortBackendMsg(uid, index) stops it in the scheduler; the reply
  that ends the last choice is the request's terminal one and removes the decode state. A
  token for a uid without decode state (aborted) is dropped.
- BackendErrorMsg: drop the decode state, send the error on as the terminal UserReply.
- LifecycleQueryMsg: forwarded to the scheduler; its answer comes back as SchedulerStateMsg
  and goes to the API server together with this worker's own counts.
- TimelineMsg (the scheduler's timeline events): passed on to the API server, with this
  worker's own events (tokenized, first output, stop string, and its end: finished,
  aborted or error) added, in the batch that goes out after the messages that caused them.
Consecutive DetokenizeMsgs are decoded in one batched tokenizer call.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

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
    TimelineEvent,
    TimelineMsg,
    TokenInfo,
    TokenizeMsg,
    TokenizerMsg,
    UserMsg,
    UserReply,
    unpack_ids,
)

from .detokenize import DetokenizeManager
from .tokenize import ToolsUnsupported, build_prompt_ids, load_tokenizer, token_bytes

logger = logging.getLogger(__name__)

# compiled grammars (and refusals) kept, by the text they came from: clients send the same
# schema again and again, and one that crashed the compiler must not crash it again
COMPILE_CACHE_ENTRIES = 256
COMPILE_CACHE_BYTES = 32 << 20


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
        timeline: bool = False,
        compiler=None,
        grammar_max_bytes: int = 1 << 17,
    ) -> None:
        self.tokenizer = tokenizer
        self.detokenize_manager = DetokenizeManager(tokenizer)
        self.send_backend = send_backend
        self.send_frontend = send_frontend
        self.timeline = timeline  # record this worker's own timeline events
        self._batch = TimelineMsg([])  # events to pass on with the next send
        self.compiler = compiler  # grammar/pool.py's GrammarCompiler; None: none here
        self.grammar_max_bytes = grammar_max_bytes
        self._compiling: dict[int, _Compiling] = {}  # uid -> request waiting for its grammar
        self._compiled: OrderedDict[tuple, tuple[str | None, int | None, str | None]] = (
            OrderedDict()
        )  # job -> (grammar, failed item, error): least recently used first
        self._compiled_bytes = 0

    def _event(self, uid: int, event: str, **detail) -> None:
        if self.timeline:
            self._batch.events.append(
                TimelineEvent(uid, "tokenizer", event, time.monotonic(), detail or None)
            )

    def _take_timeline(self) -> list[FrontendMsg]:
        batch = self._batch
        if not (batch.events or batch.step_tokens or batch.kv):
            return []
        self._batch = TimelineMsg([])
        return [batch]

    def _pass_on(self, msg: TimelineMsg) -> None:
        """The scheduler's timeline batch joins this worker's."""
        self._batch.events += msg.events
        self._batch.step_tokens += msg.step_tokens
        self._batch.kv = msg.kv or self._batch.kv

    def state(self) -> dict[str, int]:
        return {
            "decode_states": len(self.detokenize_manager.decode_map),
            "grammar_compiles": len(self._compiling),  # requests waiting for their grammar
        }

    def wait_ms(self, default: int) -> int:
        """How long the process loop may wait for messages before `handle([])` is due."""
        return self.compiler.wait_ms(default) if self._compiling else default

    def fds(self) -> list[int]:
        """File descriptors that wake the process loop: the compile processes' answers."""
        return self.compiler.fds() if self.compiler is not None else []

    # --8<-- [start:handle]
    def handle(self, msgs: list[TokenizerMsg]) -> None:
        to_backend: list[BackendMsg] = []
        to_frontend: list[FrontendMsg] = []
        if self._compiling:  # grammars compiled since the last call go first
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
                if msg.uid in self.detokenize_manager.decode_map or msg.uid in self._compiling:
                    self._event(msg.uid, "aborted")
                self.detokenize_manager.remove(msg.uid)  # the decode state goes too
                if self._compiling.pop(msg.uid, None) is not None:
                    self.compiler.cancel(msg.uid)
                to_backend.append(AbortBackendMsg(msg.uid))
            elif isinstance(msg, BackendErrorMsg):
                to_frontend += self._error(msg)
            elif isinstance(msg, LifecycleQueryMsg):
                to_backend.append(StateQueryMsg(msg.query_id, msg.flush_cache))
            elif isinstance(msg, SchedulerStateMsg):
                to_frontend.append(LifecycleStateMsg(msg.query_id, self.state(), msg.state))
            elif isinstance(msg, TimelineMsg):
                self._pass_on(msg)
        to_frontend += self._detokenize(run, to_backend)
        to_frontend += self._take_timeline()  # after the replies its events describe
        self.send_backend(to_backend)
        self.send_frontend(to_frontend)

    # --8<-- [end:handle]

    def _tokenize(self, msg: TokenizeMsg, to_frontend: list[FrontendMsg]) -> list[BackendMsg]:
        try:
            if msg.input_ids_packed is not None:
                ids = unpack_ids(msg.input_ids_packed)
            else:
                prompt = msg.messages if msg.messages is not None else msg.text or ""
                ids = build_prompt_ids(self.tokenizer, prompt, msg.tools)
        except ToolsUnsupported as exc:
            error = ErrorInfo(ErrorKind.INVALID_PROMPT, str(exc), "tools")
            return self._refuse(msg.uid, error, to_frontend)
        except Exception as exc:  # a template or tokenizer error is the request's, not ours
            logger.info("uid %d: cannot tokenize: %s", msg.uid, exc)
            error = ErrorInfo(ErrorKind.INVALID_PROMPT, f"cannot tokenize the prompt: {exc}")
            return self._refuse(msg.uid, error, to_frontend)
        self._event(msg.uid, "tokenized", prompt_tokens=len(ids))
        job = self._compile_job(msg)
        if job is None:
            return self._admit(msg, ids)
        fields, items = job
        if (error := self._check_size(msg, fields, items)) is not None:
            return self._refuse(msg.uid, error, to_frontend)
        waiting = _Compiling(msg, ids, tuple(items), fields)
        if waiting.job in self._compiled:  # compiled before: no process needed
            self._compiled.move_to_end(waiting.job)
            return self._compile_done(waiting, *self._compiled[waiting.job], to_frontend)
        if self.compiler is None:
            error = ErrorInfo(ErrorKind.INTERNAL, "this server has no grammar compiler")
            return self._refuse(msg.uid, error, to_frontend)
        self._compiling[msg.uid] = waiting
        self.compiler.submit(msg.uid, items)
        return []

    def _admit(self, msg: TokenizeMsg, ids: list[int], grammar: str | None = None) -> list:
        """The request goes to the scheduler; its decode state is created here, with the
        prompt, never by a first token."""
        params = msg.sampling_params
        echo = ""
        if msg.echo:
            echo = (
                msg.text
                if msg.text is not None
                else self.tokenizer.decode(ids, skip_special_tokens=True)
            )
        self.detokenize_manager.add(
            msg.uid, len(ids), params.n, params.stop, params.min_tokens, echo=echo
        )
        return [UserMsg.make(msg.uid, ids, params, grammar)]

    def _refuse(self, uid: int, error: ErrorInfo, to_frontend: list[FrontendMsg]) -> list:
        """A request that cannot start: one error reply, no decode state, nothing sent on."""
        self._event(uid, "error", kind=error.kind.value)
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
        """Schemas and grammars larger than --grammar-max-bytes are refused uncompiled."""
        limit = self.grammar_max_bytes
        for (param, where), (kind, text) in zip(fields, items):
            size = len(text.encode())
            if size > limit:
                what = "JSON schema" if kind == "json_schema" else "grammar of the tools"
                message = (
                    f"{where or param + ': '}the {what} is {size} bytes; this server compiles "
                    f"at most {limit} (--grammar-max-bytes)"
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
            self._event(uid, "compiled")
            return self._admit(waiting.msg, waiting.ids, grammar)
        param, where = waiting.fields[failed]
        if not where and not error.startswith("not a usable"):  # a crash or a time limit
            where = f"{param}: could not be compiled: "
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
        if not run:
            return []
        replies: list[FrontendMsg] = []
        decoded_run = self.detokenize_manager.feed(run)
        token_infos = self._token_infos(run, decoded_run)
        for msg, decoded, info in zip(run, decoded_run, token_infos):
            if decoded is None:
                continue  # late token of an aborted request or stopped choice: dropped
            if self.timeline and decoded.completion_tokens == 1 and msg.index == 0:
                self._event(msg.uid, "first_output")
            if decoded.stop_hit:  # a stop string ended this choice: the scheduler stops it
                to_backend.append(AbortBackendMsg(msg.uid, msg.index))
                self._event(msg.uid, "stop_string", index=msg.index)
            if decoded.finished:
                self._event(msg.uid, "finished", reason=decoded.finish_reason)
            replies.append(
                UserReply(
                    msg.uid,
                    decoded.text,
                    finished=decoded.finished,
                    finish_reason=decoded.finish_reason,
                    prompt_tokens=decoded.prompt_tokens,
                    completion_tokens=decoded.completion_tokens,
                    index=msg.index,
                    logprobs=info,
                    cached_tokens=decoded.cached_tokens,
                )
            )
        return replies

    def _token_infos(self, run, decoded_run) -> list[list[TokenInfo] | None]:
        """Token texts for the replies that carry logprobs, decoded in one batched call."""
        infos: list[list[TokenInfo] | None] = [None] * len(run)
        wanted = [
            i for i, (m, d) in enumerate(zip(run, decoded_run)) if d and m.logprob is not None
        ]
        if not wanted:
            return infos
        ids: list[int] = []
        for i in wanted:  # the sampled token, then its alternatives
            ids.append(run[i].next_token)
            ids += [token for token, _ in run[i].logprob.top]
        texts = iter(self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False))
        raws = iter(token_bytes(self.tokenizer, ids))
        for i in wanted:
            lp, decoded = run[i].logprob, decoded_run[i]
            token, raw = next(texts), next(raws)
            top = [(next(texts), next(raws), value) for _, value in lp.top]
            # the token's own text ends this reply's text, after any held-back text of
            # earlier tokens; a token still held back starts where the output is now
            offset = decoded.text_offset
            if token and decoded.text.endswith(token):
                offset += len(decoded.text) - len(token)
            infos[i] = [TokenInfo(token, raw, lp.logprob, offset, top)]
        return infos

    def _error(self, msg: BackendErrorMsg) -> list[FrontendMsg]:
        state = self.detokenize_manager.decode_map.get(msg.uid)
        if state is None:
            return []  # already aborted: the API server has forgotten this uid
        self.detokenize_manager.remove(msg.uid)
        self._event(msg.uid, "error", kind=msg.error.kind.value)
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


def tokenize_worker(args, model_dir: Path, channels, ready: Connection, heartbeat=None) -> None:
    """Process entry point: serve until the parent process goes away."""
    from minisgl.grammar import TokenTable
    from minisgl.grammar.pool import GrammarCompiler
    from minisgl.models.config import ModelConfig
    from minisgl.utils.heartbeat import start_beating
    from minisgl.utils.process import configure_worker_logging, parent_alive
    from minisgl.utils.zmq import PullQueue, PushQueue

    configure_worker_logging("tokenizer", args.log_level)
    start_beating(heartbeat)
    try:
        tokenizer = load_tokenizer(model_dir, args.chat_template)
        if tokenizer is None:
            raise RuntimeError(f"{model_dir} has no tokenizer: the server needs one")
        table = TokenTable.of(tokenizer, ModelConfig.from_dir(model_dir).vocab_size)
        compiler = GrammarCompiler(table, timeout=args.grammar_compile_timeout)
        inbox = PullQueue(channels.tokenizer, TokenizerMsg)
        to_scheduler = PushQueue(channels.scheduler, BackendMsg)
        to_api = PushQueue(channels.frontend, FrontendMsg)
        worker = TokenizerWorker(
            tokenizer,
            to_scheduler.put,
            to_api.put,
            timeline=args.debug_history > 0,
            compiler=compiler,
            grammar_max_bytes=args.grammar_max_bytes,
        )
    except Exception as exc:
        ready.send(("error", f"tokenizer worker failed to start: {exc}"))
        raise SystemExit(1) from exc
    ready.send(("ready", {}))
    parent = os.getppid()
    try:
        while True:
            msgs = inbox.get(timeout_ms=worker.wait_ms(500), wake_on=worker.fds())
            worker.handle(msgs)  # with nothing received, it collects compiled grammars
            if not msgs and not parent_alive(parent):
                return
    finally:
        compiler.close()
