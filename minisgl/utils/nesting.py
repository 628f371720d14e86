"""How deeply JSON nests, measured without recursion: the bound on every nested value a
request may carry.

Contract: `MAX_JSON_DEPTH` is the deepest nesting a request's JSON values may have (an
object or array counts one level, a scalar none); `value_depth(value)` measures a parsed
value and `text_depth(text)` the JSON text of one (such as a tool call's `arguments`),
each in time linear in its size and with no recursion, so a value nested 100,000 levels
deep is measured, not a RecursionError. `too_deep(what, depth)` is the message a client
gets. The request models refuse deeper values with a 400: the code that reads them
further (the chat template writing arguments back out, the schema compilers, the
schema rewriting in utils/jsonschema.py) recurses once per level.
"""

from __future__ import annotations

import re
from typing import Any

# OpenAI's strict schemas nest at most 10 levels (about 20 of JSON: each level is a
# `properties` object inside a schema object); tool arguments nest far less in practice
MAX_JSON_DEPTH = 64

_ESCAPE = re.compile(r"\\.", re.S)
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def value_depth(value: Any) -> int:
    """Levels of objects and arrays in a parsed JSON value (0 for a scalar)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def text_depth(text: str) -> int:
    """Levels of brackets in JSON text, outside its strings (0 for a scalar or for text
    with no brackets; text that is not JSON is measured all the same)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    deepest = depth = 0
    for char in brackets:
        depth = depth + 1 if char in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def too_deep(what: str, depth: int) -> str:
    return f"{what} nests {depth} levels deep, more than the {MAX_JSON_DEPTH} allowed"
