"""utils/nesting.py: depth measured without recursion, outside strings, linear in size."""

from __future__ import annotations

import json

import pytest

from minisgl.utils.nesting import MAX_JSON_DEPTH, text_depth, too_deep, value_depth

CASES = [
    ("1", 0),
    ('"[[["', 0),
    ("[]", 1),
    ('{"a": [1, {"b": [2]}]}', 4),
    ('{"a": "}}}]]]", "b": [[]]}', 3),  # brackets in strings do not count
    ('["\\"[[", [0]]', 2),  # nor do they after an escaped quote
    ('{"a": "\\\\", "b": [[1]]}', 3),  # an escaped backslash ends before the quote
]


@pytest.mark.parametrize(("text", "depth"), CASES)
def test_text_and_value_depth_agree_on_json(text, depth):
    assert text_depth(text) == depth
    assert value_depth(json.loads(text)) == depth


def test_a_hundred_thousand_levels_are_measured_not_a_recursion_error():
    deep = 100_000
    assert text_depth("[" * deep + "]" * deep) == deep
    value: list = []
    inner = value
    for _ in range(deep - 1):
        inner.append([])
        inner = inner[0]
    assert value_depth(value) == deep
    assert str(MAX_JSON_DEPTH) in too_deep("x", deep) and str(deep) in too_deep("x", deep)
