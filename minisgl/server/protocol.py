"""The request models' shared base: what every generation endpoint accepts.

Contract: as lenient as the official API and as strict. Models are strict (a wrong type is
a 400, not a silent coercion) and forbid unknown fields, so a parameter we do not implement
is refused by name, never ignored; `null` for an optional parameter means its default, as
OpenAI's nullable parameters do. Every accepted parameter that matters reaches
`SamplingParams`. The sampling parameters' rules (bounds, meaning) are declared once, on
`SamplingParams` (minisgl/core.py): `sampling_field` turns a rule into the field's
constraints and schema, `RuleChecked._rules` refuses a value outside it with the message
`LLM.generate` gives, and the relations between fields are `SamplingParams.validate`'s.
Each endpoint's own model is in its module (chat.py, completions.py, responses/).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from minisgl.core import INT32_MAX, SAMPLING_RULES, SamplingParams

# Integer bounds: what the wire format (msgpack, int32 token arrays) and the engine's
# int64 tensors can carry. Anything larger is a 400, never an overflow deep inside.
TokenId = Annotated[int, Field(**SAMPLING_RULES["stop_token_ids"].field_constraints())]
MAX_TOKENS = SAMPLING_RULES["max_tokens"].field_constraints()
# chat must generate something (as OpenAI's API); past the context left it is a 400
Count = Annotated[int, Field(**{**MAX_TOKENS, "ge": 1})]
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
_BIAS, _STOP_IDS = SAMPLING_RULES["logit_bias"], SAMPLING_RULES["stop_token_ids"]
BiasValue = Annotated[float, Field(**_BIAS.field_constraints())]
LogitBias = Annotated[dict[str, BiasValue], Field(**_BIAS.field_constraints("list"))]
StopTokenIds = Annotated[list[TokenId], Field(**_STOP_IDS.field_constraints("list"))]


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


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # random padding against side channels; not sent
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


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
    logit_bias: LogitBias | None = None
    user: str | None = None  # an end-user id: logged with the request, changes no output
    # extensions
    top_k: int = sampling_field("top_k", -1)
    min_tokens: int = sampling_field("min_tokens", 0)
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    repetition_penalty: float = sampling_field("repetition_penalty", 1.0)
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

    def output_schema(self) -> str | None:
        """The JSON schema the output must follow (structured.py's mixin has one)."""
        return None

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
            json_schema=self.output_schema(),
            grammar=grammar,
            cache_salt=self.cache_salt,
        )
