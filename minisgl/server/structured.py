"""`response_format`: structured output, what both generation endpoints accept.

Contract: `_StructuredFields` is the request models' mixin with the field. `ResponseFormat` is `text` (free text), `json_object` (any JSON object) or
`json_schema` (one JSON value valid against `json_schema.schema`); `schema_text()` is the
schema the output must follow, as JSON text (None: free text), with the keys an object
does not list forbidden unless it allows them (utils/jsonschema.py). Decoding is then
constrained by a grammar compiled from it (the tokenizer worker's preparation) and
followed token by token (the scheduler's matchers).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from minisgl.utils.jsonschema import closed_schema

from .bounded import JsonObject
from .protocol import ParamError, _Strict


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
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


class _StructuredFields(_Strict):
    response_format: ResponseFormat | None = None

    def output_schema(self) -> str | None:
        return self.response_format.schema_text() if self.response_format else None
