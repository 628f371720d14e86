"""Stop strings matched in linear time (minisgl/tokenizer/stop.py) give what the plain
definition gives: the output, streamed in pieces split anywhere, is the text up to where
the first stop string to complete begins, or all of it; before min_tokens a completed stop
string is passed over; what is held back is exactly what could still begin one. A stop
string longer than the cap is a 400 naming `stop`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from minisgl.core import MAX_STOP_LEN, SamplingParams
from minisgl.server.completions import CompletionRequest
from minisgl.tokenizer.detokenize import ChoiceState, DecodeState, DetokenizeManager
from minisgl.tokenizer.stop import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The first stop string to complete (the smallest end; at equal ends the longest) cuts
    the text where it begins."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + best[1], -best[1])):
            best = (i, len(s))
    return (text[: best[0]], True) if best else (text, False)


def stream(pieces: list[str], stops: list[str], min_pieces: int = 0) -> tuple[str, bool, int]:
    """Feed `pieces` as one choice's deltas; (text sent, stopped, most ever held back)."""
    state = DecodeState(stop=StopStrings(tuple(stops)), min_tokens=min_pieces)
    choice = ChoiceState(stop_state=state.stop.state())
    sent, most = "", 0
    for i, piece in enumerate(pieces):
        choice.tokens = i + 1
        out, hit = DetokenizeManager._apply_stop(state, choice, piece, i == len(pieces) - 1)
        sent += out
        most = max(most, choice.held_len)
        if hit:
            return sent, True, most
    return sent, False, most


ALPHABET = "ab\nc"


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_streamed_pieces_stop_where_the_plain_definition_does(pieces, stops):
    got_text, got_hit, most = stream(pieces, stops)
    want_text, want_hit = reference("".join(pieces), stops)
    assert (got_text, got_hit) == (want_text, want_hit)
    assert most < max(len(s) for s in stops)  # never more than a stop string's start


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=10),
    stop=st.text(ALPHABET, min_size=1, max_size=3),
    min_pieces=st.integers(0, 10),
)
def test_before_min_tokens_a_completed_stop_is_passed_over(pieces, stop, min_pieces):
    text = "".join(pieces)
    got_text, got_hit, _ = stream(pieces, [stop], min_pieces)
    # armed from piece `min_pieces` on: the first stop ending in an armed piece counts
    ends, pos = [], 0
    for i, piece in enumerate(pieces):
        pos += len(piece)
        ends.append((pos, i + 1 >= min_pieces))
    hits = [
        i + len(stop) for i in range(len(text)) if text.startswith(stop, i)
    ]  # every occurrence, overlapping ones too, by end
    armed_end = next(
        (e for e in hits if any(start < e <= end and ok for start, (end, ok) in _spans(ends))),
        None,
    )
    if armed_end is None:
        assert (got_text, got_hit) == (text, False)
    else:
        assert got_hit and got_text == text[: armed_end - len(stop)]


def _spans(ends):
    start = 0
    for end, ok in ends:
        yield start, (end, ok)
        start = end


def test_a_long_stop_string_whose_start_keeps_matching_holds_only_that_start():
    stop = "x" * 999 + "!"
    pieces = ["x"] * 999 + ["y"]
    text, hit, most = stream(pieces, [stop])
    assert (text, hit) == ("x" * 999 + "y", False) and most == 999


def test_a_stop_string_past_the_cap_is_a_400_naming_stop():
    body = {"prompt": "hi", "stop": ["ok", "z" * (MAX_STOP_LEN + 1)]}
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert getattr(info.value.errors()[0]["ctx"]["error"], "param", None) == "stop"
    CompletionRequest.model_validate({**body, "stop": "z" * MAX_STOP_LEN})
    assert SamplingParams(stop=["z" * (MAX_STOP_LEN + 1)]).validate()[0] == "stop"
