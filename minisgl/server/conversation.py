"""What a chat request carries besides its sampling parameters: the conversation (one
message model per role, content parts), the tools it defines, and the official fields it
accepts and ignores.

Contract: a content part other than text (image_url, input_audio, file) is a 400 naming the
part; a text part may carry extra keys (cache_control). An assistant message sent back
whole (`message.model_dump()`) is accepted: its null `audio` and `function_call`, its
`refusal` and `annotations`. `as_template_input()` is what the chat template reads of a
message. Official fields that change nothing a self-hosted server generates are accepted,
checked for type, and not used (`_IgnoredChatFields`). The fields that render the template
(`_TemplateFields`) and define tools (`_ToolFields`) are the chat request's mixins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from .bounded import JsonObject, JsonText
from .protocol import ParamError, _Strict


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
    arguments: JsonText  # as the model wrote it


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
    # the turn's thinking, which templates may show: vLLM's name now, and its older one
    # (a message dumped whole from a response carries both)
    reasoning: str | None = None
    reasoning_content: str | None = None
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
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:  # templates read it under the older name
            out["reasoning_content"] = reasoning
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
    parameters: JsonObject | None = None  # a JSON schema; omitted: no arguments
    strict: bool | None = None  # forced calls always follow `parameters` either way


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


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


class _TemplateFields(_Strict):
    """How the chat template renders the conversation: OpenAI's `reasoning_effort` (a
    template that reads it, e.g. gpt-oss's, honours it; "none" also turns Qwen3's thinking
    off unless chat_template_kwargs says otherwise), and vLLM's and SGLang's extensions:
    more template variables (`{"enable_thinking": false}`), whether the prompt ends with
    the assistant's turn opened (default: unless continue_final_message), and the last
    message left open for the model to go on with."""

    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    def _check_template(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            message = "continue_final_message goes with add_generation_prompt: false"
            raise ParamError("continue_final_message", message)
        clash = sorted(_TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if clash:
            message = f"chat_template_kwargs may not set {', '.join(clash)}: give it as a field"
            raise ParamError("chat_template_kwargs", message)

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


@dataclass
class ToolUse:
    """What one chat request asked of tools: the tools as the template shows them,
    `tool_choice` ("auto", "required" or a function's name) and `parallel_tool_calls`."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    parallel: bool = True


class _ToolFields(_Strict):
    """The functions the model may call, and how (`tool_choice`, `parallel_tool_calls`)."""

    tools: list[ToolDef] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

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
        response_format = getattr(self, "response_format", None)
        format_type = response_format.type if response_format else "text"
        if self.tool_calling() is not None and format_type != "text":
            raise ParamError("response_format", "response_format JSON cannot go with tools")

    def tool_calling(self) -> ToolUse | None:
        """What the request asked of tools; None when the model may not call any."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        return ToolUse(self.template_tools(), choice, self.parallel_tool_calls)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (none for tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
