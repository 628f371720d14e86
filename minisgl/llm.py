"""The offline API: `LLM(model=..., device=...).generate(prompts, sampling_params)`.

Contract: runs the same engine and scheduler as the server, in this process, through the
scheduler's message interface (UserMsg in, one DetokenizeMsg per step per uid out, abort by
uid). `generate` returns one `RequestOutput` per prompt, in order: text, token ids and
finish reason, or an error message for a prompt the scheduler refused. `stream` yields text
as it is produced; leaving it early aborts the requests still running, so nothing is left
in the scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.message import BackendErrorMsg, DetokenizeMsg, UserMsg
from minisgl.scheduler import Scheduler
from minisgl.tokenizer import DetokenizeManager, build_prompt_ids, load_tokenizer
from minisgl.tokenizer.tokenize import Prompt


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"; None when `error` is set
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class StreamEvent:
    index: int  # which prompt
    text: str  # new text since the previous event of this prompt
    output: RequestOutput  # the prompt's output so far; `output.finished` on its last event


class LLM:
    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        *,
        max_prefill_tokens: int = 8192,
        **engine_options,
    ) -> None:
        self.engine = Engine(
            EngineConfig(model=model, device=device, dtype=dtype, **engine_options)
        )
        self.scheduler = Scheduler(self.engine, max_prefill_tokens=max_prefill_tokens)
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._uids = itertools.count()

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
        live: dict[int, tuple[int, RequestOutput]] = {}  # uid -> (index, output)
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                uid = next(self._uids)
                ids = build_prompt_ids(self.tokenizer, prompt)
                live[uid] = (index, RequestOutput(prompt_token_ids=ids))
                if detok:
                    detok.add(uid)
                for reply in self.scheduler.process_msg(UserMsg.make(uid, ids, params)):
                    yield from self._apply([reply], live, detok)
            while live:
                yield from self._apply(self.scheduler.step(), live, detok)
        finally:
            for uid in live:  # the consumer left early: nothing stays in the scheduler
                self.scheduler.abort_req(uid)

    def _apply(self, replies, live, detok) -> Iterator[StreamEvent]:
        tokens = [r for r in replies if isinstance(r, DetokenizeMsg)]
        texts = iter(detok.feed(tokens) if detok else [None] * len(tokens))
        for reply in replies:
            index, output = live[reply.uid]
            if isinstance(reply, BackendErrorMsg):
                output.error = reply.message
                if detok:
                    detok.remove(reply.uid)
                text = ""
            else:
                decoded = next(texts)
                text = decoded.text if decoded else ""
                output.token_ids.append(reply.next_token)
                output.text += text
                output.finish_reason = reply.finish_reason
            if output.finished:
                del live[reply.uid]
            yield StreamEvent(index, text, output)


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
