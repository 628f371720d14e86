"""The offline API: `LLM(model=..., device=...).generate(prompts, sampling_params)`.

Contract: `LLM(model, **options)` takes each option by the name of its field in
`EngineConfig` (device, dtype, page_size, ...) or `SchedulerConfig` (max_prefill_tokens),
and an option left out keeps that configuration's default; or give the configurations
themselves, `LLM(engine_config=..., scheduler_config=...)` (options then override their
fields). It runs the same engine and scheduler as the server, in this process, through the
scheduler's message interface (UserMsg in, one DetokenizeMsg per step per sequence out,
abort by uid). `generate` returns one `RequestOutput` per prompt, in order: text, token ids
and finish reason (of each choice, when n > 1), the prompt logprobs when
`SamplingParams(prompt_logprobs=k)` asks (`max_tokens=0` scores a prompt without
generating), or an error message for a prompt the scheduler refused. `stream` yields text
as it is produced; leaving it early aborts the requests still running, so nothing is left
in the scheduler.

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

import gc
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from minisgl.core import SamplingParams
from minisgl.distributed import RanksFailed
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.message import (
    AbortBackendMsg,
    BackendErrorMsg,
    DetokenizeMsg,
    TokenLogprob,
    UserMsg,
)
from minisgl.scheduler import Scheduler
from minisgl.scheduler.config import SchedulerConfig, split_options
from minisgl.tokenizer import DetokenizeManager, build_prompt_ids, load_tokenizer
from minisgl.tokenizer.tokenize import Prompt


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
        engine_options, scheduler_options, unknown = split_options(options)
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
        self.engine = Engine(engine_config)
        self.scheduler = self._resources.scheduler = Scheduler(self.engine, scheduler_config)
        self.scheduler.rest_followers()  # until the first request, however long that is
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self.grammar_compile_timeout = grammar_compile_timeout
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

    def _grammar(self, params: SamplingParams) -> str | None:
        """The compiled grammar of `params`' constraint (None: free text), compiled in a
        grammar-compile process; GrammarError when it cannot be."""
        if params.json_schema is None and params.grammar is None:
            return None
        from minisgl.grammar import GrammarError, TokenTable
        from minisgl.grammar.pool import GrammarCompiler

        if self.tokenizer is None:
            raise GrammarError("this model has no tokenizer, so its output cannot be constrained")
        if self._resources.compiler is None:
            table = TokenTable.of(self.tokenizer, self.engine.model_config.vocab_size)
            self._resources.compiler = GrammarCompiler(
                table, workers=1, timeout=self.grammar_compile_timeout
            )
        if params.json_schema is not None:
            return self._resources.compiler.compile([("json_schema", params.json_schema)])
        return self._resources.compiler.compile([("lark", params.grammar)])

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
        from minisgl.grammar import GrammarError

        self._check_open()
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        detok = DetokenizeManager(self.tokenizer) if self.tokenizer else None
        live: dict[int, tuple[int, RequestOutput]] = {}  # uid -> (prompt index, output)
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                if params.stop and detok is None:
                    raise ValueError("stop strings need a tokenizer; this model has none")
                uid = next(self._uids)
                ids = build_prompt_ids(self.tokenizer, prompt)
                outputs = [CompletionOutput(i) for i in range(params.n)]
                try:
                    grammar = self._grammar(params)
                except GrammarError as e:
                    field = "json_schema" if params.json_schema is not None else "grammar"
                    output = RequestOutput(ids, outputs, error=f"{field}: {e}")
                    yield StreamEvent(index, 0, "", output)
                    continue
                live[uid] = (index, RequestOutput(ids, outputs))
                if detok:
                    detok.add(uid, len(ids), params.n, params.stop, params.min_tokens)
                msg = UserMsg.make(uid, ids, params, grammar)
                for reply in self.scheduler.process_msg(msg):
                    yield from self._apply([reply], live, detok)
            while live:
                yield from self._apply(self.scheduler.advance(), live, detok)
        except RanksFailed as e:  # a rank died or stopped: every request in flight ends here
            if self._followers:
                yield from self._fail(live, e)
                return
            raise
        finally:
            if self._finalizer.alive:
                for uid in live:  # the consumer left early: nothing stays in the scheduler
                    self.scheduler.process_msg(AbortBackendMsg(uid))
                self.scheduler.rest_followers()

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

    def _apply(self, replies, live, detok) -> Iterator[StreamEvent]:
        tokens = [r for r in replies if isinstance(r, DetokenizeMsg)]
        decoded_iter = iter(detok.feed(tokens) if detok else [None] * len(tokens))
        for reply in replies:
            is_token = isinstance(reply, DetokenizeMsg)
            decoded = next(decoded_iter) if is_token else None  # in step with `tokens`
            if reply.uid not in live:
                continue  # its request ended earlier in this step
            index, output = live[reply.uid]
            if isinstance(reply, BackendErrorMsg):
                output.error = reply.error.message
                if detok:
                    detok.remove(reply.uid)
                del live[reply.uid]
                yield StreamEvent(index, 0, "", output)
                continue
            choice = output.outputs[reply.index]
            if choice.finish_reason is not None:
                continue  # its stop string was already seen
            if reply.next_token is not None:  # None: it ended with its prompt (max_tokens 0)
                choice.token_ids.append(reply.next_token)
            if reply.prompt_logprobs is not None:
                output.prompt_logprobs = [None, *reply.prompt_logprobs]
            output.cached_tokens = max(output.cached_tokens, reply.cached_tokens)
            if reply.logprob is not None:
                choice.logprobs.append(reply.logprob)
            text = decoded.text if decoded else ""
            choice.text += text
            choice.finish_reason = decoded.finish_reason if decoded else reply.finish_reason
            if decoded is not None and decoded.stop_hit:
                self.scheduler.process_msg(AbortBackendMsg(reply.uid, reply.index))
            if output.finished:
                del live[reply.uid]
            yield StreamEvent(index, reply.index, text, output)


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

    def release(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
            self.compiler = None
        if self.followers:
            from minisgl.distributed_worker import stop_ranks

            followers, self.followers = self.followers, []
            stop_ranks(self.scheduler, followers, failed=self.failure is not None)
