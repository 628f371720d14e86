"""POST /v1/chat/completions: its request model, its output format and its route.

Contract: `ChatCompletionRequest` is what the route accepts (its conversation and tool
definitions: conversation.py; the shared sampling fields and rules: protocol.py).
`v1_chat_completions` checks the model, builds the `TokenizeMsg` maker and the
`ChatFormat`, and hands both to `respond` (response.py), which owns the request's
lifecycle; it never waits itself. What splits a choice's text into reasoning, content and
tool calls is the server's output parsers' (minisgl/parsers/, chosen by flag, read from the
app's state; choice_text.py is the one tie to them, by interface). The shapes validate as
the `openai` client's `ChatCompletion` and `ChatCompletionChunk`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from minisgl.core import SamplingParams
from minisgl.message import TokenInfo, TokenizeMsg

from .buffer import ChoiceOutput, Output
from .choice_text import ChoiceText, ToolCalls
from .conversation import ChatMessage, _IgnoredChatFields, _TemplateFields, _ToolFields
from .endpoint import salted, unknown_model
from .formats import OutputFormat
from .protocol import Count, ParamError, _SamplingFields, sampling_field
from .response import Job, respond
from .structured import _StructuredFields

router = APIRouter()


# --8<-- [start:request_model]
# --8<-- [start:request_model_core]
class ChatCompletionRequest(
    _TemplateFields, _ToolFields, _IgnoredChatFields, _StructuredFields, _SamplingFields
):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("top_logprobs")

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError(
                "max_completion_tokens", "give max_completion_tokens or max_tokens, not both"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        self._check_template()
        self._check_tools()
        return self

    # --8<-- [end:request_model_core]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, tools: ToolCalls | None = None) -> SamplingParams:
        """`tools`: the request's tool-call format, whose grammar forces the calls that
        tool_choice requires (the route makes it with the server's tool-call parser)."""
        max_tokens = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        grammar = tools.grammar() if tools is not None else None
        return self._sampling_params(max_tokens, logprobs, grammar)


# --8<-- [end:request_model]


class ChatFormat(OutputFormat):
    """With `tools` (the request's tool-call format), each choice's text goes through its
    parser: its tool-call blocks become `tool_calls` (streamed as `delta.tool_calls`: a
    call's id and name once its block shows them, then its arguments piece by piece) and
    the rest stays content. With `reasoning` (the --reasoning-parser's class), the think
    block ahead of them becomes `reasoning`, sent also as `reasoning_content` (vLLM's name
    now and its older one, which clients of either read), in messages and deltas alike."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def __init__(
        self,
        model: str,
        n_choices: int = 1,
        tools: ToolCalls | None = None,
        reasoning: Callable[[bool], Any] | None = None,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(model, n_choices, continuous_usage)
        self.tools = tools
        self.reasoning = reasoning
        self.reasoning_open = False  # the output starts inside the think block
        self._texts: dict[int, ChoiceText] = {}  # per choice, while it streams

    def _choice_text(self, index: int) -> ChoiceText:
        if index not in self._texts:
            parser = self.reasoning(self.reasoning_open) if self.reasoning else None
            self._texts[index] = ChoiceText(self.tools, parser)
        return self._texts[index]

    def _parse(self, choice: ChoiceOutput) -> tuple[str, list[dict[str, Any]]]:
        """The content of the choice's new text and the calls it completed, whole (for a
        format that sends each call at once: responses/format.py)."""
        parsed = self._choice_text(choice.index)
        _, content, _ = parsed.feed(choice.text, choice.finish_reason)
        return content, parsed.completed_calls()

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if self.tools is None:
            return reason
        return self.tools.finish_reason(reason, bool(self._choice_text(index).calls))

    def _delta(self, choice: ChoiceOutput, first: bool, output: Output) -> dict[str, Any] | None:
        self.reasoning_open = self.reasoning_open or output.reasoning_open
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        reasoning, content, calls = self._choice_text(choice.index).feed(
            choice.text, choice.finish_reason
        )
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if not delta and not choice.logprobs:
            return None
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": _chat_logprobs(choice.logprobs) if choice.logprobs else None,
            "finish_reason": None,
        }

    def _end(self, choice: ChoiceOutput) -> dict[str, Any]:
        reason = self._finish_reason(choice.index, choice.finish_reason)
        return {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def _choice(self, index: int, text: str, finish: str | None, logprobs) -> dict[str, Any]:
        self._texts.pop(index, None)
        parsed = self._choice_text(index)
        reasoning, content, _ = parsed.feed(text, finish or "stop")
        calls = parsed.calls
        # no text besides reasoning or calls (or none allowed besides calls): null content
        empty = None if calls or reasoning or (self.tools and self.tools.forced) else ""
        message: dict[str, Any] = {"role": "assistant", "content": content or empty}
        if self.reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": self._finish_reason(index, finish),
        }


def _chat_logprobs(infos: list[TokenInfo]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": info.token,
                "logprob": info.logprob,
                "bytes": list(info.raw),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": list(raw)} for text, raw, lp in info.top
                ],
            }
            for info in infos
        ],
        "refusal": None,
    }


# --8<-- [start:chat_route]
@router.post("/v1/chat/completions")
async def v1_chat_completions(req: ChatCompletionRequest, request: Request):
    served = request.app.state
    if (refusal := unknown_model(request, req.model)) is not None:
        return refusal
    tools = served.parsers.tool_calls(req.tool_calling())
    fmt = ChatFormat(served.model_name, req.n, tools, continuous_usage=req.continuous_usage)
    return respond(request, req, chat_job(request, req, fmt))


def chat_job(request: Request, req: ChatCompletionRequest, fmt: ChatFormat) -> Job:
    """How a chat request is served, in the wire format `fmt` (chat, or responses)."""
    params = salted(request, req.sampling_params(fmt.tools))
    fmt.renamed = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens else {}
    messages = [m.as_template_input() for m in req.messages]
    tools = req.template_tools()
    parsers = request.app.state.parsers
    # a constrained output (forced calls, JSON) is all answer: it has no think block
    free = params.grammar is None and params.json_schema is None
    reasoning = request.app.state.args.reasoning_parser if free else None
    fmt.reasoning = parsers.reasoning if free else None  # its think block is read out

    def make_msg(uid: int) -> TokenizeMsg:
        return TokenizeMsg(
            uid,
            params,
            messages=messages,
            tools=tools,
            add_generation_prompt=req.generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.template_kwargs(),
            reasoning=reasoning,
        )

    return Job([make_msg], fmt, params.n, req.logprobs, req.include_usage)


# --8<-- [end:chat_route]
