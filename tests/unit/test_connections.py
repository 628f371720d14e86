"""The connection guards' pieces that a server test cannot reach: accept failures (out of
file descriptors) are logged once per period with a count, not once per attempt; other
loop errors still reach the previous handler; the default connection cap follows the
process's descriptor limit."""

from __future__ import annotations

import asyncio
import logging
import resource

from minisgl.server.connections import default_max_connections, quiet_accept_errors


def test_accept_failures_are_logged_once_per_period_with_a_count(caplog):
    loop = asyncio.new_event_loop()
    others = []
    loop.set_exception_handler(lambda loop, context: others.append(context["message"]))
    try:
        quiet_accept_errors(loop, every=60.0)
        with caplog.at_level(logging.ERROR, logger="minisgl.server.connections"):
            for _ in range(5000):
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource",
                     "exception": OSError(24, "Too many open files")}
                )  # fmt: skip
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accepting connections failed" in r.getMessage()]
    assert len(lines) == 1 and "1 time(s)" in lines[0].getMessage()
    assert others == ["something else"]


def test_the_default_cap_is_half_the_descriptor_limit_at_most_4096():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = default_max_connections()
    assert cap <= 4096 and (soft == resource.RLIM_INFINITY or cap <= max(16, soft // 2))
