"""Who may see what, when several clients share the server under API keys.

Contract: the key a request came with gives it a role (`role_var`, set by the API key
middleware): OPERATOR (the `--admin-key`; or the only `--api-key` when no admin key is
set, since one key is one tenant; or everybody, when no key is set at all), TENANT (one of
several `--api-key`s, or the one key beside an admin key), ANONYMOUS (no key, on a route
that needs none). What each role sees:
- `POST /debug/flush_cache` and `GET /metrics` are the operator's (its counters tell the
  prompt tokens each request looked up in the prefix cache and found there);
- `GET /debug/requests` shows a tenant only its own requests (`owner_filter`);
- `GET /debug/lifecycle` stays open, so that anyone can check the server is back at zero,
  but to all but the operator it tells counts of requests, never their sizes (`coarse`):
  the byte and page totals rounded up to a power of two, the prefix cache's totals left out.
"""

from __future__ import annotations

import contextvars
from typing import Any

OPERATOR, TENANT, ANONYMOUS = "operator", "tenant", "anonymous"
role_var: contextvars.ContextVar[str] = contextvars.ContextVar("role", default=OPERATOR)

# the prefix cache's counts: left out of what a non-operator sees
_CACHE = (
    "kv_pages_cached",
    "prefix_cache_nodes",
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
)


OPERATOR_ROUTES = ("/debug/flush_cache", "/metrics")  # path prefixes


def api_keys(value: str | None) -> list[str]:
    """The keys of `--api-key A,B,...` (each one a tenant)."""
    return [key.strip() for key in (value or "").split(",") if key.strip()]


def operator_only(path: str) -> bool:
    """Whether the route at `path` answers only the operator."""
    return path.startswith(OPERATOR_ROUTES)


def role_of(key: bytes | None, admin: bytes | None, keys: list[bytes]) -> str:
    """The role a request with `key` (None: no key, or a wrong one) has."""
    if key is None:
        return ANONYMOUS
    if key == admin or (admin is None and keys == [key]):
        return OPERATOR
    return TENANT


def owner_filter(tenant: str | None) -> str | None:
    """Whose timelines the request may read: None, everybody's (the operator); else the
    digest of its own key (`tenant`)."""
    return None if role_var.get() == OPERATOR else (tenant or "")


def round_up(n: int) -> int:
    """`n` rounded up to a power of two (0 stays 0: the zero check still holds)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def coarse(lifecycle: dict[str, Any]) -> dict[str, Any]:
    """A /debug/lifecycle answer as anyone but the operator may see it."""
    if role_var.get() == OPERATOR:
        return lifecycle
    sched = lifecycle["scheduler"]
    for counts in (sched, *sched.get("ranks", ())):
        for name in _CACHE:
            counts.pop(name, None)
        counts["kv_pages_used"] = round_up(counts["kv_pages_used"])
    frontend = lifecycle["frontend"]
    frontend["pending_bytes"] = round_up(frontend["pending_bytes"])
    return lifecycle
