"""JSON schemas as a constraint on output: what a schema leaves unsaid is closed.

Contract: `closed_schema(schema)` is `schema` with `additionalProperties: false` wherever an
object lists its `properties` and leaves other keys unsaid (values such as `const` stay as
they are), as xgrammar's strict mode does: a small model otherwise invents extra keys.
Used for `response_format` and for the parameters of forced tool calls.
"""

from __future__ import annotations

from typing import Any

_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` wherever an object lists its
    `properties` and leaves other keys unsaid (values such as `const` stay as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out
