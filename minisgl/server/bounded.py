"""Request fields that carry JSON of their own, bounded in how deeply it nests.

Contract: `JsonObject` (a JSON schema: `response_format`, a tool's `parameters`),
`JsonValue` (any parsed JSON) and `JsonText` (JSON as text: a tool call's `arguments`) are
pydantic field types that refuse, with a 400 naming the depth, anything nested deeper than
`MAX_JSON_DEPTH` (utils/nesting.py): the code that reads them further (the chat template
writing arguments back out, the grammar compilers, utils/jsonschema.py) recurses once per
level, and a RecursionError there would be a 500.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from minisgl.utils.nesting import MAX_JSON_DEPTH, text_depth, too_deep, value_depth


def _shallow(value: Any) -> Any:
    if (depth := value_depth(value)) > MAX_JSON_DEPTH:
        raise ValueError(too_deep("this JSON value", depth))
    return value


def _shallow_text(text: str) -> str:
    if (depth := text_depth(text)) > MAX_JSON_DEPTH:
        raise ValueError(too_deep("this JSON text", depth))
    return text


# a JSON schema (response_format, a tool's parameters) or the JSON text of a tool call's
# arguments: the code that reads them further recurses once per level (utils/nesting.py)
JsonObject = Annotated[dict[str, Any], AfterValidator(_shallow)]
JsonValue = Annotated[Any, AfterValidator(_shallow)]
JsonText = Annotated[str, AfterValidator(_shallow_text)]
