"""`POST /v1/responses` (OpenAI's Responses API), stateless: the request side.

Contract: `ResponsesRequest` is what the route accepts. It is strict like the chat models
(a wrong type is a 400, a field OpenAI does not define is a 400 naming it) and as lenient
as OpenAI about fields that change nothing a self-hosted server generates (`store`,
`metadata`, `user`, `service_tier`, `truncation: "disabled"`, `reasoning`, `include`, ...:
accepted, and `null` means the default). Its one job is translation: `chat` is the
`ChatCompletionRequest` the request means, built once when it is validated, so a
Responses request runs exactly the chat path (the chat template, tools and their grammar,
`text.format` as `response_format`, sampling, the request scope and its lifecycle rules);
the output side is format.py.

How `input` becomes chat messages: `instructions` first, as a system message; a string is
one user message; `message` items keep their role and their text parts (`input_text`,
`output_text`, `refusal`); an assistant message and the `function_call` items after it are
one assistant turn with `tool_calls`; a `function_call_output` is a `tool` message
answering its `call_id`; `reasoning` items (which this server never produces) are dropped.

The sampling parameters of the chat path that the Responses API does not define but that
mean the same here (OpenAI chat's `stop`, `seed`, `presence_penalty`, `frequency_penalty`,
`logit_bias`; vLLM's and SGLang's `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `cache_salt`: PEER_SAMPLING) are accepted as the chat path accepts them
and pass to it unchanged, so a load generator that sends `ignore_eos` to every endpoint (as
guidellm does) is served here too; one the chat path refuses (`min_p`) is refused here.

What cannot be served is a 400 saying why: `previous_response_id`, `conversation` and
`prompt` need state the server does not keep (`store` is ignored); an image, file or audio
part is not for a text-only model; tools other than functions, and items of other kinds,
name what they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..bounded import JsonObject, JsonText, JsonValue
from ..chat import ChatCompletionRequest
from ..conversation import FunctionName
from ..protocol import (
    Count,
    LogitBias,
    ParamError,
    RuleChecked,
    StopList,
    StopString,
    StopTokenIds,
    sampling_field,
)

STATELESS = (
    "this server keeps no responses (store is ignored): send the whole conversation in "
    "`input` instead"
)
# where a check of the chat request (or a worker's answer to it) names a field, the name
# the client used
CHAT_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
# the chat path's sampling parameters that the Responses API lacks, passed to it as sent
PEER_SAMPLING = (
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "repetition_penalty",
    "cache_salt",
)
# include values OpenAI defines: none asks for anything this server would otherwise leave out
# (it has no built-in tools, images, or encrypted reasoning to add), except logprobs
INCLUDABLE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# ---------------------------------------------------------------- input items
class _MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: FunctionName
    arguments: JsonText
    id: str | None = None
    status: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")
    # the official client's parsed form of `arguments` (ParsedResponseFunctionToolCall),
    # sent back when a program appends the items of a streamed response to its input
    parsed_arguments: JsonValue = None


class _FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class _ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEMS: dict[str, type[_Strict]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
    "reasoning": _ReasoningItem,
}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            what = f"{kind} parts are" if isinstance(kind, str) else "a part without a type is"
            raise ParamError(
                f"{where}.{j}", f"{where}[{j}]: {what} not supported by this text-only model"
            )
        if not isinstance(part.get(key), str):
            raise ParamError(f"{where}.{j}.{key}", f"{where}[{j}].{key} must be a string")
        pieces.append(part[key])
    return "".join(pieces)


def _parse_item(i: int, raw: Any) -> _Strict:
    where = f"input.{i}"
    if not isinstance(raw, dict):
        raise ParamError(where, f"input[{i}] must be an object (an input item)")
    kind = raw.get("type", "message")
    if kind == "item_reference":
        raise ParamError(where, f"input[{i}]: an item_reference needs stored items; {STATELESS}")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ParamError(f"{where}.type", f"input[{i}]: {kind} items are not supported here")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        field = f"{where}.{loc}" if loc else where
        if first["type"] == "extra_forbidden":
            raise ParamError(field, f"unsupported parameter: {field}") from None
        raise ParamError(field, f"{field}: {first['msg']}") from None


def chat_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages (as ChatCompletionRequest takes them) that `input` stands for."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    names: dict[str, str] = {}  # call_id -> the function it called
    for i, item in enumerate(_parse_item(i, raw) for i, raw in enumerate(items)):
        if isinstance(item, _MessageItem):
            text = _text(item.content, f"input.{i}.content")
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, _FunctionCallItem):
            names[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, _FunctionCallOutputItem):
            tool = {
                "role": "tool",
                "tool_call_id": item.call_id,
                "content": _text(item.output, f"input.{i}.output"),
            }
            if (name := item.name or names.get(item.call_id)) is not None:
                tool["name"] = name
            messages.append(tool)
        # reasoning items: this server produces none, and a template would not show them
    return messages


# ---------------------------------------------------------------- tools and text
class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    parameters: JsonObject | None = None
    strict: bool | None = None
    description: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    output_schema: JsonObject | None = None

    def as_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.parameters, "strict": self.strict}
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }

    def as_output(self) -> dict[str, Any]:
        """As a Response lists its tools."""
        out = {"type": "function", "name": self.name, "parameters": self.parameters}
        return out | {"strict": self.strict, "description": self.description}


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: JsonObject | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ParamError("text.format", "a json_schema format needs `name` and `schema`")
        return self

    def as_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description}
        schema["strict"] = self.strict
        return {
            "type": "json_schema",
            "json_schema": {k: v for k, v in schema.items() if v is not None},
        }

    def as_output(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "schema": self.schema_,
            "description": self.description,
            "strict": self.strict,
        }


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # changes nothing here


class Reasoning(_Strict):
    """Accepted: a model without a reasoning mode answers the same either way."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is ever sent


# ---------------------------------------------------------------- the request
class ResponsesRequest(_Strict, RuleChecked):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    # accepted, and changing nothing here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # built-in tools: there are none
    background: bool | None = None
    top_logprobs: int | None = sampling_field("top_logprobs")
    # state this server does not keep: only null
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    # the chat path's (PEER_SAMPLING): null or absent is the chat path's default
    stop: StopString | StopList | None = None
    seed: int | None = sampling_field("seed")
    presence_penalty: float | None = sampling_field("presence_penalty")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    logit_bias: LogitBias | None = None
    top_k: int | None = sampling_field("top_k")
    min_tokens: int | None = sampling_field("min_tokens")
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    repetition_penalty: float | None = sampling_field("repetition_penalty")
    cache_salt: str | None = sampling_field("cache_salt")

    _chat: ChatCompletionRequest | None = None

    @model_validator(mode="after")
    def _translate(self):
        for name in ("previous_response_id", "conversation", "prompt"):
            if getattr(self, name) is not None:
                raise ParamError(name, f"{name} is not supported: {STATELESS}")
        if self.context_management:
            raise ParamError("context_management", "context_management is not supported here")
        if self.background:
            raise ParamError("background", "background responses need stored state; " + STATELESS)
        if self.truncation == "auto":
            message = "truncation 'auto' is not supported: this server never drops input"
            raise ParamError("truncation", message)
        for value in self.include or []:
            if value not in INCLUDABLE:
                raise ParamError("include", f"include value {value!r} is not supported here")
        if self.top_logprobs:
            raise ParamError("top_logprobs", "logprobs are served on /v1/chat/completions")
        if isinstance(self.input, list) and not self.input:
            raise ParamError("input", "input must not be empty")
        messages = chat_messages(self.instructions, self.input)
        chat = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": [t.as_chat() for t in self.tools] if self.tools else None,
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.as_chat()
            if self.text and self.text.format
            else None,
        }
        chat |= {name: getattr(self, name) for name in PEER_SAMPLING}
        try:
            self._chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in chat.items() if v is not None}
            )
        except ValidationError as exc:
            raise _in_responses_terms(exc) from None
        return self

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            return {"type": "function", "function": {"name": choice.name}}
        return choice if self.tools else None  # a choice among no tools is "none" anyway

    @property
    def chat(self) -> ChatCompletionRequest:
        """The chat request this one stands for."""
        assert self._chat is not None
        return self._chat


def _in_responses_terms(exc: ValidationError) -> ParamError:
    """A check of the translated chat request, naming the field as the client sent it."""
    first = exc.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return ParamError(CHAT_NAMES.get(cause.param, cause.param), str(cause))
    loc = [str(p) for p in first.get("loc", ())]
    if loc:
        loc[0] = CHAT_NAMES.get(loc[0], loc[0])
    param = ".".join(loc) or "input"
    return ParamError(param, f"{param}: {first.get('msg')}")
