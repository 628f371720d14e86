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
generating), or an error message for a prompt the scheduler refused. `stream` yields text as it is produced; leaving it early aborts the
requests still running, so nothing is left in the scheduler.

`LLM(tp_size=N)` shards the model over N ranks on torch.distributed (gloo on the CPU, NCCL
on CUDA, one GPU per rank): this process is rank 0 and starts the other N - 1 as child
processes (`minisgl.distributed_worker`), which follow its scheduler. `close()` stops them
(also at interpreter exit).
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from minisgl.core import SamplingParams
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


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        **options: Any,
    ) -> None:
        if model is not None:
            options["model"] = model
        engine_options, scheduler_options, unknown = split_options(options)
        if unknown:
            names = ", ".join(sorted(unknown))
            raise TypeError(f"LLM() got options that neither configuration has: {names}")
        engine_config = replace(engine_config or EngineConfig(), **engine_options)
        scheduler_config = replace(scheduler_config or SchedulerConfig(), **scheduler_options)
        self._followers = []
        if engine_config.tp_size > 1:  # ranks 1..N-1 in child processes; this one is rank 0
            from minisgl.distributed_worker import start_ranks

            self._followers = start_ranks(engine_config, scheduler_config)
        self.engine = Engine(engine_config)
        self.scheduler = Scheduler(self.engine, scheduler_config)
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._uids = itertools.count()
        if self._followers:
            atexit.register(self.close)

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism); a no-op otherwise, and when repeated."""
        if not self._followers:
            return
        from minisgl.distributed import destroy_tp

        followers, self._followers = self._followers, []
        self.scheduler.stop_followers()
        for proc in followers:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        destroy_tp()

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
                live[uid] = (index, RequestOutput(ids, outputs))
                if detok:
                    detok.add(uid, len(ids), params.n, params.stop, params.min_tokens)
                for reply in self.scheduler.process_msg(UserMsg.make(uid, ids, params)):
                    yield from self._apply([reply], live, detok)
            while live:
                yield from self._apply(self.scheduler.advance(), live, detok)
        finally:
            for uid in live:  # the consumer left early: nothing stays in the scheduler
                self.scheduler.process_msg(AbortBackendMsg(uid))

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
