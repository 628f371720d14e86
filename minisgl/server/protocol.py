"""The OpenAI request models: what /v1/chat/completions and /v1/completions accept.

Contract: as lenient as the official API and as strict. Models are strict (a wrong type is
a 400, not a silent coercion) and forbid unknown fields, so a parameter we do not
implement (functions, suffix, audio, ...) is refused by name, never ignored. `null` for an
optional parameter means its default, as OpenAI's nullable parameters do. Official fields
that change nothing a self-hosted server generates are accepted and ignored (store,
metadata, service_tier, prompt_cache_key, safety_identifier, verbosity, prediction; on an
assistant message sent back: refusal, annotations, audio and function_call when null). A
content part other than text (image_url, input_audio, file) is a 400 naming the part; a
text part may carry extra keys (cache_control). Every accepted parameter that matters
reaches `SamplingParams`, the response format or the chat template. Extensions beyond
OpenAI's API, as in vLLM and SGLang: top_k, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty, chat_template_kwargs, add_generation_prompt, continue_final_message,
stream_options.continuous_usage_stats.

The sampling parameters' rules (bounds, meaning) are declared once, on `SamplingParams`
(minisgl/core.py): `sampling_field` turns a rule into the field's constraints and schema,
`_SamplingFields._rules` refuses a value outside it with the message `LLM.generate` gives,
and the relations between fields are `SamplingParams.validate`'s own.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from minisgl.core import INT32_MAX, MAX_N, MAX_SEQUENCES, SAMPLING_RULES, SamplingParams

from .tools import ToolCalling, closed_schema

# Integer bounds: what the wire format (msgpack, int32 token arrays) and the engine's
# int64 tensors can carry. Anything larger is a 400, never an overflow deep inside.
TokenId = Annotated[int, Field(**SAMPLING_RULES["stop_token_ids"].field_constraints())]
_MAX_TOKENS = SAMPLING_RULES["max_tokens"].field_constraints()
# chat must generate something (as OpenAI's API); larger max_tokens are clamped anyway
Count = Annotated[int, Field(**{**_MAX_TOKENS, "ge": 1})]
# completions' max_tokens may be 0: with echo that scores the prompt and generates nothing
CompletionCount = Annotated[int, Field(**_MAX_TOKENS)]
# a request field named otherwise than the SamplingParams field whose rule it follows
_RULE_OF = {
    "max_completion_tokens": "max_tokens",
    "max_output_tokens": "max_tokens",  # /v1/responses
    "top_logprobs": "logprobs",
}


def sampling_field(name: str, default: Any = None, **extra: Any) -> Any:
    """The request field for SamplingParams' `name`: its meaning and bounds as that field
    declares them, so /openapi.json shows what is checked (`_SamplingFields._rules` checks
    it, with the message `LLM.generate` gives)."""
    rule = SAMPLING_RULES[_RULE_OF.get(name, name)]
    return Field(default, description=rule.meaning, **rule.field_constraints(), **extra)


_STOP = SAMPLING_RULES["stop"]
StopString = Annotated[str, Field(**_STOP.field_constraints())]
StopList = Annotated[list[StopString], Field(**_STOP.field_constraints("list"))]
BiasValue = Annotated[float, Field(**SAMPLING_RULES["logit_bias"].field_constraints())]


class ParamError(ValueError):
    """A cross-field check failed; `param` names the parameter for the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# --8<-- [start:strict_model]
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"field": null` for an optional field is the field left out (OpenAI's nullable
        parameters); a required field stays null and is refused."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        optional = set()
        for name, f in cls.model_fields.items():
            if not f.is_required():
                optional |= {name, f.alias or name}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


# --8<-- [end:strict_model]


class TextPart(_Strict):
    # extra keys such as Anthropic-style `cache_control` change nothing here
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str

    @property
    def value(self) -> str:
        return self.text


class RefusalPart(_Strict):
    """What an earlier assistant turn refused, sent back in its content."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["refusal"]
    refusal: str

    @property
    def value(self) -> str:
        return self.refusal


# parts of other modalities: a text-only model cannot read them
UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video_url")


def _content(value: Any) -> str | list[TextPart | RefusalPart]:
    """A message's content: a string or a list of text parts, checked part by part so
    that a part we cannot serve is named, not lost in a union error."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSUPPORTED_PARTS:
            raise PydanticCustomError(
                "unsupported_content_part",
                "content[{j}]: {kind} parts are not supported by this text-only model",
                {"j": j, "kind": kind},
            )
        if kind not in ("text", "refusal"):
            raise PydanticCustomError(
                "unsupported_content_part",
                "content[{j}]: unknown content part type {kind!r}",
                {"j": j, "kind": kind},
            )
        parts.append((TextPart if kind == "text" else RefusalPart).model_validate(part))
    return parts


Content = Annotated[
    str | list[TextPart | RefusalPart],
    PlainValidator(_content, json_schema_input_type=str | list[TextPart | RefusalPart]),
]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # as OpenAI checks


class CalledFunction(_Strict):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class AssistantToolCall(_Strict):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    def as_template_input(self) -> dict[str, Any]:
        # templates write the arguments with `tojson`: give them the object when there is one
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class _Message(_Strict):
    """One message of the conversation; `as_template_input` is what chat templates read."""

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if content is not None and not isinstance(content, str):
            content = "".join(part.value for part in content)
        # "developer" is OpenAI's newer name for the system role; chat templates know "system"
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Message):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Message):
    """An earlier answer, as a client sends it back (often a response's `message`
    dumped whole: its null `audio` and `function_call` and its `annotations` come along)."""

    role: Literal["assistant"]
    content: Content | None = None  # None (or absent) when the turn only called tools
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # the tools this turn called
    refusal: str | None = None  # what the answer refused, if anything; unused
    annotations: list[Any] | None = None  # OpenAI's URL citations; unused
    reasoning_content: str | None = None  # the turn's thinking: templates may show it
    # not served (no audio, and the deprecated form of tool_calls): only null is accepted
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _check_message(self):
        if self.content is None and not self.tool_calls:
            raise ParamError("messages", "an assistant message needs content or tool_calls")
        return self

    def as_template_input(self) -> dict[str, Any]:
        out = super().as_template_input()
        if self.tool_calls:
            out["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ToolMessage(_Message):
    """A tool's result, answering the assistant's call `tool_call_id`."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str
    name: str | None = None  # the function's name, which some templates show

    def as_template_input(self) -> dict[str, Any]:
        out = {**super().as_template_input(), "tool_call_id": self.tool_call_id}
        if self.name is not None:
            out["name"] = self.name
        return out


# one model per role, told apart by `role` (as in OpenAI's own API description)
ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted: no arguments
    strict: bool | None = None  # forced calls always follow `parameters` either way


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # random padding against side channels; not sent
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema either way


class ResponseFormat(_Strict):
    """`text`, `json_object` (any JSON object) or `json_schema` (one JSON value valid
    against `json_schema.schema`): decoding is constrained by a grammar compiled from it."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ParamError("response_format", "json_schema goes with type json_schema only")
        return self

    def schema_text(self) -> str | None:
        """The schema the output must follow, as JSON text (None: free text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            # properties it does not list are forbidden unless it allows them, as in
            # xgrammar's strict default: pydantic's schemas leave that unsaid
            return json.dumps(closed_schema(self.json_schema.schema_))
        return None


class RuleChecked(BaseModel):
    """A request model (mixed in) whose fields named as SamplingParams' (or in `_RULE_OF`)
    follow its rules."""

    # --8<-- [start:sampling_rules]
    # check_fields=False: the fields are those of the subclasses
    @field_validator(*SAMPLING_RULES, *_RULE_OF, mode="before", check_fields=False)
    @classmethod
    def _rules(cls, value: Any, info: ValidationInfo) -> Any:
        """Each field's rule as SamplingParams declares it, with its message, before the
        type check (a value of the wrong type, or null, passes to that: the request field's
        own type says whether null is allowed)."""
        name = info.field_name
        if value is None:
            return value
        if (message := SAMPLING_RULES[_RULE_OF.get(name, name)].problem(name, value)) is not None:
            raise ParamError(name, message)
        return value

    # --8<-- [end:sampling_rules]


# --8<-- [start:sampling_fields]
class _SamplingFields(_Strict, RuleChecked):
    """Parameters shared by both endpoints."""

    model: str | None = None  # omitted: the served model (as vLLM and llama.cpp allow)
    max_tokens: Count | None = None
    temperature: float = sampling_field("temperature", 1.0)  # OpenAI's default
    top_p: float = sampling_field("top_p", 1.0)
    n: int = sampling_field("n", 1)
    stop: StopString | StopList | None = Field(None, description=_STOP.meaning)
    seed: int | None = sampling_field("seed")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # --8<-- [end:sampling_fields]
    presence_penalty: float = sampling_field("presence_penalty", 0.0)
    frequency_penalty: float = sampling_field("frequency_penalty", 0.0)
    logit_bias: dict[str, BiasValue] | None = None
    user: str | None = None  # an end-user id: logged with the request, changes no output
    # extensions
    top_k: int = sampling_field("top_k", -1)
    min_tokens: int = sampling_field("min_tokens", 0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: float = sampling_field("repetition_penalty", 1.0)
    response_format: ResponseFormat | None = None
    # vLLM's: requests share cached prefix pages only when their salts are equal
    cache_salt: str | None = sampling_field("cache_salt")

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ParamError("logit_bias", f"logit_bias keys are token ids, got {key!r}")
        # the relations between fields, as SamplingParams states them
        relations = SamplingParams(max_tokens=self.requested_max_tokens, min_tokens=self.min_tokens)
        if (problem := relations.validate()) is not None:
            raise ParamError(*problem)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's continuous_usage_stats, which needs include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, grammar: str | None = None
    ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            n=self.n,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            json_schema=self.response_format.schema_text() if self.response_format else None,
            grammar=grammar,
            cache_salt=self.cache_salt,
        )


# keyword arguments of apply_chat_template itself: a template variable may not replace them
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
     "sanitize_control_tokens"}
)  # fmt: skip
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _IgnoredChatFields(_Strict):
    """Official fields that change nothing this server generates: accepted, checked for
    type, and not used (what a hosted service stores, bills, caches or routes by)."""

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None  # predicted output: a latency hint only
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None  # audio output's voice and format: only null

    @model_validator(mode="after")
    def _check_modalities(self):
        if self.modalities is not None and "audio" in self.modalities:
            message = "modalities: this server generates text only, not audio"
            raise ParamError("modalities", message)
        if self.audio is not None:
            raise ParamError("audio", "audio: this server generates text only, not audio")
        return self


# --8<-- [start:request_model]
# --8<-- [start:request_model_core]
class ChatCompletionRequest(_IgnoredChatFields, _SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = sampling_field("top_logprobs")
    tools: list[ToolDef] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # reaches the chat template (a template that reads it, e.g. gpt-oss's, honours it);
    # "none" also turns Qwen3's thinking off unless chat_template_kwargs says otherwise
    reasoning_effort: ReasoningEffort | None = None
    # extensions (vLLM's and SGLang's meanings): more chat template variables, e.g.
    # {"enable_thinking": false}; whether the prompt ends with the assistant's turn opened
    # (default: unless continue_final_message); the last message left open, for the model
    # to go on with
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError(
                "max_completion_tokens", "give max_completion_tokens or max_tokens, not both"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            message = "continue_final_message goes with add_generation_prompt: false"
            raise ParamError("continue_final_message", message)
        clash = sorted(_TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if clash:
            message = f"chat_template_kwargs may not set {', '.join(clash)}: give it as a field"
            raise ParamError("chat_template_kwargs", message)
        self._check_tools()
        return self

    # --8<-- [end:request_model_core]

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort."""
        out: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
            if self.reasoning_effort == "none":
                out["enable_thinking"] = False
        out.update(self.chat_template_kwargs or {})
        return out or None

    @property
    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tool names must be unique")
        if self.tool_choice is not None and not self.tools:
            raise ParamError("tool_choice", "tool_choice is only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                message = f"tool_choice names {self.tool_choice.function.name!r}, not in tools"
                raise ParamError("tool_choice", message)
        format_type = self.response_format.type if self.response_format else "text"
        if self.tool_calling() is not None and format_type != "text":
            raise ParamError("response_format", "response_format JSON cannot go with tools")

    def tool_calling(self) -> ToolCalling | None:
        """What the request asked of tools; None when the model may not call any."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        return ToolCalling(self.template_tools(), choice, self.parallel_tool_calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (none for tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        calling = self.tool_calling()
        grammar = calling.grammar() if calling is not None else None
        return self._sampling_params(max_tokens, logprobs, grammar)


# --8<-- [end:request_model]


class CompletionRequest(_SamplingFields):
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
