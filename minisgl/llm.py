"""The offline API: `LLM(model=..., device=...).generate(prompts, sampling_params)`.

Contract: `LLM(model, **options)` takes each option by the name of its field in
`EngineConfig` (device, dtype, page_size, ...) or `SchedulerConfig` (max_prefill_tokens),
and an option left out keeps that configuration's default; or give the configurations
themselves, `LLM(engine_config=..., scheduler_config=...)` (options then override their
fields). It runs the server's own stages in this process: the same `TokenizerWorker`
(prompts, chat templates, tools, grammars, stop strings, detokenization, logprob texts) and
the same scheduler and engine, wired by two lists instead of ZMQ. `generate` returns one
`RequestOutput` per prompt, in order: text, token ids and finish reason (of each choice,
when n > 1), the prompt logprobs when `SamplingParams(prompt_logprobs=k)` asks
(`max_tokens=0` scores a prompt without generating), or an error message for a prompt that
was refused. `stream` yields text as it is produced; leaving it early aborts the requests
still running, so nothing is left in the worker or the scheduler.

A constrained request (`SamplingParams.json_schema` or `grammar`) is compiled in a
grammar-compile process (minisgl/grammar/pool.py, started on the first one), so a schema
that crashes or stalls the grammar library fails that request, not this process: its
output has the error, naming the field.

`LLM(tp_size=N)` shards the model over N ranks on torch.distributed (gloo on the CPU, NCCL
on CUDA, one GPU per rank): this process is rank 0 and starts the other N - 1 as child
processes (`minisgl.distributed_worker`), which follow its scheduler. They stop with
`close()`, at the end of a `with LLM(...) as llm:` block, when the object is garbage
collected, and at interpreter exit, whichever comes first; one process is in one
tensor-parallel group at a time, so a second such `LLM` while one is open is an error. A
rank that dies or stops ends every request in flight with an error within
`dist_timeout` seconds (the LLM is then closed), rather than hanging.
"""

from __future__ import annotations

import functools
import gc
import itertools
import select
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from minisgl.core import SamplingParams
from minisgl.distributed import RanksFailed
from minisgl.engine.build import build_engine
from minisgl.engine.config import EngineConfig
from minisgl.message import (
    AbortMsg,
    DetokenizeMsg,
    TokenizeMsg,
    TokenLogprob,
    UserMsg,
    UserReply,
    pack_ids,
)
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig
from minisgl.tokenizer import load_tokenizer
from minisgl.tokenizer.prepare import Preparation
from minisgl.tokenizer.server import TokenizerWorker
from minisgl.tokenizer.tokenize import Prompt
from minisgl.utils.flags import split_options


@dataclass
class CompletionOutput:
    index: int  # which choice
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once the choice has ended
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # SamplingParams(prompt_logprobs=k): per prompt token, its logprob given the tokens
    # before it and k alternatives; None for the first token, which nothing predicts
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(o.finish_reason for o in self.outputs)

    # the first choice, which is all there is unless n > 1
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return None if self.error else self.outputs[0].finish_reason


@dataclass
class StreamEvent:
    index: int  # which prompt
    choice: int  # which choice of it
    text: str  # new text of that choice since its previous event
    output: RequestOutput  # the prompt's output so far; `output.finished` on its last event


_open_tp: weakref.ref | None = None  # the tensor-parallel LLM of this process, if any


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        grammar_compile_timeout: float = 5.0,
        **options: Any,
    ) -> None:
        global _open_tp
        if model is not None:
            options["model"] = model
        engine_options, scheduler_options, unknown = split_options(
            options, EngineConfig, SchedulerConfig
        )
        if unknown:
            names = ", ".join(sorted(unknown))
            raise TypeError(f"LLM() got options that neither configuration has: {names}")
        engine_config = replace(engine_config or EngineConfig(), **engine_options)
        scheduler_config = replace(scheduler_config or SchedulerConfig(), **scheduler_options)
        self._followers = []
        self._resources = _Resources()  # released by close(), the finalizer or at exit
        self._finalizer = weakref.finalize(self, self._resources.release)
        if engine_config.tp_size > 1:  # ranks 1..N-1 in child processes; this one is rank 0
            from minisgl.distributed_worker import start_ranks

            if _open_tp is not None and _open_tp() is not None:
                gc.collect()  # a dropped one caught in a reference cycle goes now
            if _open_tp is not None and _open_tp() is not None:
                raise RuntimeError(
                    "another LLM with tp_size > 1 is open in this process: close() it (or "
                    "leave its `with` block) first; a process is in one tensor-parallel "
                    "group at a time"
                )
            self._followers = self._resources.followers = start_ranks(
                engine_config, scheduler_config
            )
            _open_tp = weakref.ref(self)
        self.engine = build_engine(engine_config)
        self.scheduler = self._resources.scheduler = Scheduler(self.engine, scheduler_config)
        self.scheduler.ranks.rest()  # until the first request, however long that is
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        # the server's own tokenizer worker, wired to this scheduler by two lists: what it
        # sends the scheduler, and its replies (which become this object's outputs)
        self._backend: list = []
        self._replies: list[UserReply] = []
        prepare = Preparation(
            self.tokenizer,
            functools.partial(  # no reference to this object: it stays collectable
                self._resources.compiler_for,
                self.tokenizer,
                self.engine.model_config.vocab_size,
                grammar_compile_timeout,
            ),
            max_seq_len=self.engine.max_seq_len,
        )
        self.worker = TokenizerWorker(
            self.tokenizer, self._backend.extend, self._replies.extend, prepare
        )
        self._uids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism) and the grammar compiler, if any; a
        no-op when repeated."""
        self._followers = []
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            why = self._resources.failure or "close() was called"
            raise RuntimeError(f"this LLM is closed ({why}); create a new one")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        for event in self.stream(prompt_list, sampling_params):
            results[event.index] = event.output
        return results  # type: ignore[return-value]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        self._check_open()
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if self.tokenizer is None and any(p.stop for p in params_list):
            raise ValueError("stop strings need a tokenizer; this model has none")
        # the request rules SamplingParams declares, checked (with the messages the HTTP
        # server gives) before anything is queued: a refused prompt's result is its error
        problems = [params.validate() for params in params_list]
        live: dict[int, tuple[int, RequestOutput]] = {}  # uid -> (prompt index, output)
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                if (problem := problems[index]) is not None:
                    refused = RequestOutput([], [CompletionOutput(i) for i in range(params.n)])
                    refused.error = f"{problem[0]}: {problem[1]}"
                    yield StreamEvent(index, 0, "", refused)
                    continue
                uid = next(self._uids)
                live[uid] = (
                    index,
                    RequestOutput([], [CompletionOutput(i) for i in range(params.n)]),
                )
                self.worker.handle([_tokenize_msg(uid, prompt, params)])
                yield from self._pump(live)
            while live:
                if self.scheduler.has_work:
                    self._to_worker(self.scheduler.advance(), live)
                else:  # only the tokenizer worker has work: a prompt or a grammar on its way
                    select.select(self.worker.fds(), [], [], self.worker.wait_ms(50) / 1000)
                    self.worker.handle([])
                yield from self._pump(live)
        except RanksFailed as e:  # a rank died or stopped: every request in flight ends here
            if self._followers:
                yield from self._fail(live, e)
                return
            raise
        finally:
            if self._finalizer.alive:
                # the consumer left early: nothing stays in the worker or the scheduler
                self.worker.handle([AbortMsg(uid) for uid in live])
                self.scheduler.process_msgs(self._backend_msgs())
                self._replies.clear()
                self.scheduler.ranks.rest()

    def _backend_msgs(self) -> list:
        msgs, self._backend[:] = list(self._backend), []
        return msgs

    def _to_worker(self, replies: list, live) -> None:
        """The scheduler's replies go to the tokenizer worker, as in the server; on the way,
        each choice's token ids (which replies to the client do not carry) are kept."""
        for reply in replies:
            if isinstance(reply, DetokenizeMsg) and reply.uid in live:
                output = live[reply.uid][1]
                choice = output.outputs[reply.index]
                if choice.finish_reason is None and reply.next_token is not None:
                    choice.token_ids.append(reply.next_token)
                    if reply.logprob is not None:
                        choice.logprobs.append(reply.logprob)
                if reply.prompt_logprobs is not None:
                    output.prompt_logprobs = [None, *reply.prompt_logprobs]
        self.worker.handle(replies)

    def _pump(self, live) -> Iterator[StreamEvent]:
        """Until nothing moves: the worker's messages to the scheduler go in (with the
        scheduler's answers back to the worker), its replies become events."""
        while self._backend or self._replies:
            msgs = self._backend_msgs()
            for msg in msgs:
                if isinstance(msg, UserMsg) and msg.uid in live:
                    live[msg.uid][1].prompt_token_ids = msg.input_ids
            if msgs:
                self._to_worker(self.scheduler.process_msgs(msgs), live)
            replies, self._replies[:] = list(self._replies), []
            for reply in replies:
                yield from self._apply(reply, live)

    def _apply(self, reply: UserReply, live) -> Iterator[StreamEvent]:
        if reply.uid not in live:
            return
        index, output = live[reply.uid]
        if reply.error is not None:
            field = _OFFLINE_FIELDS.get(reply.error.field, reply.error.field)
            output.error = f"{field}: {reply.error.message}" if field else reply.error.message
            del live[reply.uid]
            yield StreamEvent(index, 0, "", output)
            return
        choice = output.outputs[reply.index]
        choice.text += reply.incremental_output
        choice.finish_reason = reply.finish_reason or choice.finish_reason
        output.cached_tokens = max(output.cached_tokens, reply.cached_tokens)
        if reply.finished:
            del live[reply.uid]
        # a model with no tokenizer has no text to wait for: each of its tokens is an event
        news = reply.incremental_output or self.tokenizer is None
        if news or reply.finish_reason or reply.finished:
            yield StreamEvent(index, reply.index, reply.incremental_output, output)

    def _fail(self, live, exc: RanksFailed) -> Iterator[StreamEvent]:
        message = (
            f"a tensor-parallel rank did not answer within {self.engine.config.dist_timeout:g} s "
            f"(dist_timeout): {exc}"
        )
        self._resources.failure = message
        self.close()
        for index, output in list(live.values()):
            output.error = message
            yield StreamEvent(index, 0, "", output)
        live.clear()


# the HTTP names of a refused field, as the offline API names them
_OFFLINE_FIELDS = {"response_format": "json_schema", "tools": "grammar"}


def _tokenize_msg(uid: int, prompt: Prompt, params: SamplingParams) -> TokenizeMsg:
    if isinstance(prompt, str):
        return TokenizeMsg(uid, params, text=prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return TokenizeMsg(uid, params, input_ids_packed=pack_ids(list(prompt)))
    if prompt and all(isinstance(m, dict) for m in prompt):
        return TokenizeMsg(uid, params, messages=list(prompt))
    if not prompt:
        return TokenizeMsg(uid, params, input_ids_packed=pack_ids([]))
    raise TypeError("a prompt is a string, a list of token ids or a list of chat messages")


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if prompts and all(isinstance(m, dict) for m in prompts):
        return [list(prompts)]  # one chat conversation
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)


class _Resources:
    """What an LLM must give back, apart from the LLM itself, so that its finalizer can
    release it without keeping the LLM alive: the other ranks and the grammar compiler."""

    def __init__(self) -> None:
        self.scheduler = None
        self.followers: list = []
        self.compiler = None
        self.failure: str | None = None  # why the ranks failed, when they did

    def compiler_for(self, tokenizer, vocab_size: int, timeout: float):
        """The grammar compiler of an LLM's tokenizer worker, started on the first
        constrained request (one compile process)."""
        from minisgl.grammar import TokenTable
        from minisgl.grammar.pool import GrammarCompiler

        table = TokenTable.of(tokenizer, vocab_size) if tokenizer is not None else None
        self.compiler = GrammarCompiler(table, workers=1, timeout=timeout)
        return self.compiler

    def release(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None
        if self.followers:
            from minisgl.distributed_worker import stop_ranks

            followers, self.followers = self.followers, []
            stop_ranks(self.scheduler, followers, failed=self.failure is not None)
