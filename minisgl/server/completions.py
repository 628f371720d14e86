"""POST /v1/completions: its request model, its output format and its route.

Contract: `CompletionRequest` takes one prompt or several, as text or token ids; each
prompt is one request scope (one uid) of the same HTTP request, its `n` choices numbered
after the previous prompt's (choice i of prompt p is choice p * n + i). `echo` returns the
prompt with the output and, with `logprobs: N`, the prompt's tokens with their logprobs
(the first null) and N alternatives; `max_tokens: 0` then only scores the prompt. A
request whose prompts x n reach the number of requests the server serves at once
(--max-concurrent-requests) is a 400: it would take every slot, or could never start. The shapes validate as the `openai` client's
`Completion`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from minisgl.core import MAX_N, MAX_SEQUENCES, SamplingParams
from minisgl.message import TokenInfo, TokenizeMsg, pack_ids

from .buffer import ChoiceOutput, Output
from .endpoint import refused, salted, unknown_model
from .formats import OutputFormat
from .protocol import MAX_TOKENS, ParamError, TokenId, _SamplingFields, sampling_field
from .response import Job, respond
from .structured import _StructuredFields

router = APIRouter()
# completions' max_tokens may be 0: with echo that scores the prompt and generates nothing
CompletionCount = Annotated[int, Field(**MAX_TOKENS)]


class CompletionRequest(_StructuredFields, _SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: CompletionCount | None = 16  # OpenAI's default for completions
    logprobs: int | None = sampling_field("logprobs")
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None  # text after the completion (insertion): only null

    @model_validator(mode="after")
    def _check_suffix(self):
        if self.suffix is not None:
            raise ParamError(
                "suffix", "suffix (text to insert the completion before) is not supported"
            )
        return self

    @model_validator(mode="after")
    def _check_completion(self):
        if not self.prompt or any(p in ("", []) for p in self.prompts()):
            raise ParamError("prompt", "prompt must not be empty")
        if len(self.prompts()) * self.n > MAX_SEQUENCES:
            message = (
                f"{len(self.prompts())} prompts x n={self.n} sequences is more than the "
                f"{MAX_SEQUENCES} one request may ask for; split the prompts over requests"
            )
            raise ParamError("prompt", message)
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported (it needs ranking)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt given as token ids
        return list(p)

    def sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get theirs
            params.prompt_logprobs = self.logprobs
        return params


class CompletionFormat(OutputFormat):
    object = "text_completion"
    chunk_object = "text_completion"  # OpenAI streams completions as the same object
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def _delta(self, choice: ChoiceOutput, first: bool, output: Output) -> dict[str, Any] | None:
        if not choice.text and not choice.logprobs:
            return None
        logprobs = _completion_logprobs(choice.logprobs) if choice.logprobs else None
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": None,
        }

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": "",
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }

    def _choice(self, index: int, text: str, finish: str | None, logprobs) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": finish,
        }


def _completion_token(text: str, raw: bytes) -> str:
    """A token that holds only part of a character is named by its bytes, as OpenAI does."""
    if "\ufffd" in text and raw:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _completion_logprobs(infos: list[TokenInfo]) -> dict[str, Any]:
    """OpenAI's shape: each token's alternatives always hold the token itself (so up to
    `logprobs` + 1 of them); the echoed prompt's first token has null for both."""
    top: list[dict[str, float] | None] = []
    for info in infos:
        if info.logprob is None:  # the prompt's first token: nothing predicts it
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for text, raw, lp in info.top:  # best first: a repeated name keeps its best value
            alternatives.setdefault(_completion_token(text, raw), lp)
        alternatives.setdefault(_completion_token(info.token, info.raw), info.logprob)
        top.append(alternatives)
    return {
        "tokens": [_completion_token(info.token, info.raw) for info in infos],
        "token_logprobs": [info.logprob for info in infos],
        "top_logprobs": top,
        "text_offset": [info.offset for info in infos],
    }


@router.post("/v1/completions")
async def v1_completions(req: CompletionRequest, request: Request):
    served = request.app.state
    if (refusal := unknown_model(request, req.model)) is not None:
        return refusal
    params = salted(request, req.sampling_params())
    prompts, limit = req.prompts(), served.frontend.max_concurrent
    if len(prompts) * params.n >= limit:  # it would take every slot, or could never start
        message = (
            f"this request asks for {len(prompts)} prompts x n={params.n} sequences, as many "
            f"as the {limit} requests this server serves at once (--max-concurrent-requests) "
            "or more; split it"
        )
        return refused(request, 400, message, code="too_many_prompts", param="prompt")

    def maker(prompt: str | list[int]) -> Callable[[int], TokenizeMsg]:
        if isinstance(prompt, str):
            return lambda uid: TokenizeMsg(uid, params, text=prompt, echo=req.echo)
        packed = pack_ids(prompt)
        return lambda uid: TokenizeMsg(uid, params, input_ids_packed=packed, echo=req.echo)

    fmt = CompletionFormat(served.model_name, len(prompts) * params.n, req.continuous_usage)
    job = Job(
        [maker(p) for p in prompts], fmt, params.n, req.logprobs is not None, req.include_usage
    )
    return respond(request, req, job)
