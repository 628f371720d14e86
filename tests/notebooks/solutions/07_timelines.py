"""Reference solution of notebook 07's exercise: the order in which processes ended."""

from __future__ import annotations

END_EVENTS = {"finished", "aborted", "error"}


def end_order(timeline: dict) -> list[str]:
    ends = [e for e in timeline["events"] if e["event"] in END_EVENTS]
    return [e["process"] for e in sorted(ends, key=lambda e: e["t"])]
