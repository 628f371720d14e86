"""The grammar-compile pool contains what native code does to it: a compiler that
segfaults or hangs fails that one job with the reason (the item at fault named), is
replaced, and the next job compiles; jobs queue behind busy processes and their time limit
runs from when a process takes them; a cancelled job's answer is dropped; a compiler that
cannot start fails jobs at once rather than hanging them; the real compiler turns a bad
schema into its error and a good one into llguidance's grammar."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from minisgl.grammar import GrammarError
from minisgl.grammar.pool import GrammarCompiler

FAKE = f"{__name__}:fake"


def fake(kind: str, text: str, tokenizer) -> str:
    """A compiler run in the compile process: misbehaves as `text` says."""
    if text == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if text == "hang":
        time.sleep(3600)
    if text.startswith("sleep:"):
        time.sleep(float(text.removeprefix("sleep:")))
    if text == "bad":
        raise GrammarError("not a usable JSON schema: bad")
    return f"grammar of {text}"


def _collect(pool: GrammarCompiler, keys: set, timeout: float = 30.0) -> dict:
    """Wait for the answers of `keys`."""
    import select

    got, deadline = {}, time.monotonic() + timeout
    while set(got) != keys:
        assert time.monotonic() < deadline, f"no answer for {keys - set(got)}"
        for result in pool.collect():
            got[result.key] = result
        select.select(pool.fds(), [], [], pool.wait_ms(100) / 1000)
    return got


@pytest.fixture
def pool():
    pool = GrammarCompiler(None, workers=1, timeout=2.0, compiler=FAKE)
    yield pool
    pool.close()


def test_a_compiler_that_segfaults_fails_its_job_and_the_next_one_compiles(pool):
    assert pool.compile([("json_schema", "ok")]) == "grammar of ok"
    with pytest.raises(GrammarError, match=r"crashed \(signal SIGSEGV\)"):
        pool.compile([("json_schema", "segfault")])
    assert pool.crashes == 1
    assert pool.compile([("json_schema", "fine")]) == "grammar of fine"


def test_a_compiler_that_hangs_is_killed_at_the_time_limit(pool):
    start = time.monotonic()
    with pytest.raises(GrammarError, match=r"longer than 2 s"):
        pool.compile([("json_schema", "hang")])
    assert 2.0 <= time.monotonic() - start < 20.0
    assert pool.compile([("json_schema", "after")]) == "grammar of after"


def test_the_item_at_fault_is_named(pool):
    pool.submit("a", [("json_schema", "one"), ("json_schema", "segfault"), ("lark", "x")])
    pool.submit("b", [("json_schema", "one"), ("json_schema", "bad")])
    pool.submit("c", [("json_schema", "one"), ("lark", "two")])
    got = _collect(pool, {"a", "b", "c"})
    assert (got["a"].failed, got["b"].failed) == (1, 1)
    assert "crashed" in got["a"].error and got["b"].error.endswith("bad")
    assert got["c"].error is None and got["c"].grammar == "grammar of two"


def test_jobs_queue_behind_a_busy_process_and_their_limit_starts_when_taken(pool):
    pool.submit("slow", [("json_schema", "sleep:1.5")])
    pool.submit("next", [("json_schema", "sleep:1.5")])  # 3 s after submit: within its 2 s
    assert pool.pending() == 2
    got = _collect(pool, {"slow", "next"})
    assert got["slow"].grammar and got["next"].grammar, got
    assert pool.pending() == 0


def test_a_cancelled_job_is_never_answered(pool):
    pool.submit("gone", [("json_schema", "sleep:0.5")])
    pool.submit("queued", [("json_schema", "x")])
    pool.cancel("gone")  # running: its answer is dropped
    pool.cancel("queued")  # queued: never sent
    pool.submit("kept", [("json_schema", "y")])
    assert set(_collect(pool, {"kept"})) == {"kept"}
    time.sleep(0.7)
    assert pool.collect() == [] and pool.pending() == 0


def test_a_compiler_that_cannot_start_fails_jobs_at_once():
    pool = GrammarCompiler(None, workers=1, timeout=2.0, compiler="no_such_module:f")
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match="cannot start|could not start"):
            pool.compile([("json_schema", "x")])
        assert time.monotonic() - start < 20.0
    finally:
        pool.close()


def test_the_real_compiler_refuses_a_bad_schema_and_compiles_a_good_one(tiny_dirs):
    from minisgl.grammar import TokenTable
    from minisgl.models.config import ModelConfig
    from minisgl.tokenizer import load_tokenizer

    table = TokenTable.of(
        load_tokenizer(tiny_dirs["llama"]), ModelConfig.from_dir(tiny_dirs["llama"]).vocab_size
    )
    pool = GrammarCompiler(table, workers=1, timeout=10.0)
    try:
        grammar = pool.compile([("json_schema", json.dumps({"type": "boolean"}))])
        assert "json_schema" in json.loads(grammar)["grammars"][0]
        with pytest.raises(GrammarError, match="not a usable JSON schema"):
            pool.compile([("json_schema", '{"type": "no-such-type"}')])
        with pytest.raises(GrammarError, match="not a usable grammar"):
            pool.compile([("lark", "start: no_such_rule")])
    finally:
        pool.close()
