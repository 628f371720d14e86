"""Reference solution of notebook 04's exercise: is every request's state released?"""

from __future__ import annotations

# the per-request counts; kv_pages_total, kv_pages_cached and prefix_cache_* are not
PER_REQUEST = ("pending", "running", "table_slots_used", "kv_pages_used", "grammar_matchers")


def all_released(state: dict) -> bool:
    ranks = [state["scheduler"], *state["scheduler"].get("ranks", [])]
    return (
        state["frontend"]["requests"] == 0
        and state["frontend"]["pending_bytes"] == 0
        and state["tokenizer"]["decode_states"] == 0
        and all(rank.get(key, 0) == 0 for rank in ranks for key in PER_REQUEST)
    )
