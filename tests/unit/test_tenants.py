"""Who sees what under API keys, without a server: the role a key gives (the admin key, or
the only key, is the operator's), the rounding that keeps a zero a zero, the lifecycle a
non-operator sees (request counts, no cache totals, sizes rounded), and the timelines a
tenant may read (its own only, no KV samples)."""

from __future__ import annotations

import copy

import pytest

from minisgl.server import tenants
from minisgl.server.tenants import ANONYMOUS, OPERATOR, TENANT, coarse, role_of, round_up
from minisgl.timeline.api import Timelines
from minisgl.timeline.events import Finished


def test_the_role_a_key_gives():
    a, b, admin = b"a", b"b", b"admin"
    assert role_of(None, admin, [a, b]) == ANONYMOUS
    assert role_of(admin, admin, [a, b]) == OPERATOR
    assert role_of(a, admin, [a, b]) == TENANT
    assert role_of(a, None, [a, b]) == TENANT  # several tenants and no admin: no operator
    assert role_of(a, None, [a]) == OPERATOR  # one key: one tenant, who runs the server
    assert role_of(a, admin, [a]) == TENANT  # ... unless an admin key is set


@pytest.mark.parametrize(("n", "up"), [(0, 0), (1, 1), (2, 2), (3, 4), (1000, 1024), (1024, 1024)])
def test_sizes_round_up_to_a_power_of_two_and_zero_stays_zero(n, up):
    assert round_up(n) == up


LIFECYCLE = {
    "frontend": {"requests": 1, "pending_bytes": 300},
    "tokenizer": {"decode_states": 1},
    "scheduler": {
        "running": 1,
        "kv_pages_used": 5,
        "kv_pages_total": 100,
        "kv_pages_cached": 7,
        "prefix_cache_nodes": 3,
        "prefix_cache_query_tokens": 77,
        "prefix_cache_hit_tokens": 12,
        "ranks": [{"rank": 1, "kv_pages_used": 5, "prefix_cache_hit_tokens": 12}],
    },
}


def test_a_non_operator_sees_counts_not_sizes():
    token = tenants.role_var.set(TENANT)
    try:
        seen = coarse(copy.deepcopy(LIFECYCLE))
    finally:
        tenants.role_var.reset(token)
    assert seen["frontend"] == {"requests": 1, "pending_bytes": 512}
    assert seen["tokenizer"] == {"decode_states": 1}
    sched = seen["scheduler"]
    assert sched["running"] == 1 and sched["kv_pages_used"] == 8 and sched["kv_pages_total"] == 100
    assert not {"kv_pages_cached", "prefix_cache_nodes", "prefix_cache_query_tokens"} & set(sched)
    assert sched["ranks"] == [{"rank": 1, "kv_pages_used": 8}]
    # the operator (and everybody, when no key is set) sees the counts as they are
    assert coarse(copy.deepcopy(LIFECYCLE)) == LIFECYCLE


def test_a_tenant_reads_only_its_own_timelines():
    store = Timelines(history=10)
    for uid, owner in enumerate(("alice", "bob", "alice", None)):
        store.start(uid, f"r{uid}", "/v1/chat/completions", 1.0, 1.0, owner)
    store.end(Finished(0, "api", 2.0, reason="stop"), 3, 1)
    store.kv.append((1.0, 4, 0, 100))
    mine = store.snapshot({}, owner="alice")
    assert [t["request_id"] for t in mine["in_flight"]] == ["r2"]
    assert [t["request_id"] for t in mine["ended"]] == ["r0"]
    assert mine["in_flight_total"] == 1 and mine["kv_pages"] == []
    assert store.snapshot({}, request_id="r1", owner="alice")["in_flight"] == []
    everyone = store.snapshot({})
    assert everyone["in_flight_total"] == 3 and len(everyone["kv_pages"]) == 1
    assert tenants.owner_filter("alice") is None  # the operator's filter: none
    token = tenants.role_var.set(TENANT)
    try:
        assert tenants.owner_filter("alice") == "alice"
    finally:
        tenants.role_var.reset(token)
