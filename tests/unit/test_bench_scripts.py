"""The pieces of benchmarks/online.py and benchmarks/frontend.py run and count right.

The benchmarks need a server and minutes; these tests check, in milliseconds, what their
figures rest on: the bare baseline sends exactly the bytes minisgl's StreamResponse sends,
the client's byte counting survives any cut of the stream, the workload and percentiles
are what the docs say, a py-spy profile is summed up correctly, and vs_llamacpp.py skips
without a llama-server (saying how to build one) and takes medians and ratios per round.
"""

from __future__ import annotations

import math

# benchmarks/ is on pytest's pythonpath (pyproject.toml), as the scripts' own folder is on
# theirs when they run
import frontend
import frontend_stack
import online
import pytest

from minisgl.server.buffer import ChoiceOutput, Output
from minisgl.server.chat import ChatFormat
from minisgl.server.formats import SSE_DONE


@pytest.mark.parametrize("n", [1, 2, 5])
def test_bare_sends_the_bytes_of_our_stream_response(n):
    """Same sends as StreamResponse.serve for n outputs of one token each."""
    fmt = ChatFormat(frontend_stack.MODEL_NAME)
    ours = []
    for i in range(n):
        last = i == n - 1
        choice = ChoiceOutput(0, frontend_stack.WORD, "length" if last else None, [])
        body = fmt.chunks(Output([choice], 10, i + 1, last, None))
        ours.append(body + SSE_DONE if last else body)
    bare = frontend_stack.bare_chunks(frontend_stack.MODEL_NAME, n, frontend_stack.WORD)
    norm = frontend.normalize_stream  # ids and times aside, as the benchmark compares
    assert [norm(b) for b in bare] == [norm(o) for o in ours]
    assert [len(b) for b in bare] == [len(o) for o in ours]


def test_tally_counts_chunks_and_tokens_across_any_cut():
    stream = b"".join(frontend_stack.bare_chunks("m", 7, " hello"))
    for cut in range(1, 40, 3):
        tally, chunks, tokens = frontend_stack.Tally(b" hello"), 0, 0
        for i in range(0, len(stream), cut):
            c, w = tally.feed(stream[i : i + cut])
            chunks, tokens = chunks + c, tokens + w
        assert (chunks, tokens) == (7, 7)


def test_online_prompts_arrivals_and_percentiles():
    import common

    prompts = online.make_prompts(3, 50, seed=1)
    assert prompts == online.make_prompts(3, 50, seed=1)
    assert all(len(p.split()) == 50 for p in prompts)
    assert online.arrival_offsets(4, math.inf, 0) == [0.0] * 4
    offsets = online.arrival_offsets(2000, 10.0, 0)
    assert offsets == sorted(offsets)
    assert 180 < offsets[-1] < 220  # 2000 arrivals at 10/s
    p = common.percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (p["p50"], p["p90"], p["p99"]) == pytest.approx((50, 90, 99))
    assert common.percentiles([])["p50"] is None


def test_online_summary_counts_tokens_of_finished_requests():
    ok = online.RequestResult(ok=True, start=0.0, end=1.0, ttft=0.1, chunk_times=[0.1, 0.2, 0.4],
                              finish_reason="length", prompt_tokens=10, completion_tokens=60)  # fmt: skip
    bad = online.RequestResult(ok=False, start=0.0, end=0.5, error="HTTP 503")
    load = online.Load("http://x", num_requests=2)
    s = online.summarize(load, "m", [ok, bad], 2.0)
    assert (s["requests_ok"], s["requests_failed"], s["errors"]) == (1, 1, ["HTTP 503"])
    assert s["output_tokens"] == 60 and s["output_tokens_per_s"] == 30.0  # the streams' usage
    assert s["content_chunks"] == 3 and s["prompt_tokens_per_request"] == 10
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["ttft_ms"]["p99"] == pytest.approx(100)


def test_online_stream_counts_usage_and_fails_without_it_or_a_finish_reason():
    import asyncio

    import httpx

    content = 'data: {"choices":[{"index":0,"delta":{"content":"a b"},"finish_reason":null}]}\n\n'
    finish = 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    usage = 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'

    def stream(*events: str) -> online.RequestResult:
        body = "".join(events).encode() + b"data: [DONE]\n\n"
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

        async def go():
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
                return await online.stream_one(client, {})

        return asyncio.run(go())

    res = stream(content, finish, usage)
    assert res.ok and (res.prompt_tokens, res.completion_tokens) == (3, 2)
    assert res.finish_reason == "length" and len(res.chunk_times) == 1 and res.ttft is not None
    no_usage = stream(content, finish)
    assert not no_usage.ok and "usage" in no_usage.error
    no_finish = stream(content, usage)
    assert not no_finish.ok and "finish_reason" in no_finish.error


def test_frontend_defaults_match_the_readme():
    args = frontend.parse_args([])
    assert (args.concurrency, args.max_tokens, args.tokens, args.paced_tokens) == (
        [1, 16, 64],
        256,
        100000,
        30000,
    )


def test_profile_summary_of_collapsed_stacks():
    raw = (
        "<module> (x.py:1);listen (/r/minisgl/server/frontend.py:10);append "
        "(/r/minisgl/server/frontend.py:20) 30\n"
        "<module> (x.py:1);write (/v/site-packages/h11/_conn.py:5) 70\n"
    )
    s = frontend.summarize_collapsed(raw.replace("/r/", str(frontend.REPO) + "/"))
    assert s["samples"] == 100
    assert dict(s["self_pct"]) == {
        "h11/_conn.py:write": 70.0,
        "minisgl/server/frontend.py:append": 30.0,
    }
    assert dict(s["minisgl_inclusive_pct"])["minisgl/server/frontend.py:listen"] == 30.0


@pytest.mark.parametrize("overlap", ["--overlap", "--disable-overlap-schedule"])
def test_step_overhead_phases_add_up(tmp_path, overlap):
    """A tiny run of benchmarks/step_overhead.py: every phase is there, none is negative and
    together they take no more than the step's wall time, with and without overlap."""
    import json

    import step_overhead

    out = tmp_path / "steps.json"
    argv = ["--device", "cpu", "--batch-sizes", "1", "2", "--steps", "2", "--warmup", "1"]
    argv += ["--hidden-size", "64", "--vocab-size", "512", "--prompt-len", "4", overlap]
    assert step_overhead.main([*argv, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["overlap"] is (overlap == "--overlap")
    results = record["results"]
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert len(r["steps"]) == 2
        for step in [*r["steps"], r["mean_s"]]:
            assert set(step_overhead.PHASES) <= set(step)
            assert all(step[p] >= -1e-9 for p in step_overhead.PHASES), step
            measured = sum(step[p] for p in step_overhead.PHASES if p != "other")
            assert 0 < measured <= step["wall"] * (1 + 1e-9), step
            assert step["forward"] > 0 and step["schedule"] > 0 and step["post"] > 0


def test_vs_llamacpp_without_a_binary_says_how_to_build_one_and_skips(capsys, tmp_path):
    import vs_llamacpp

    assert vs_llamacpp.main(["--llama-server", str(tmp_path / "llama-server")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("skipped: no llama-server binary")
    assert "pip download --no-deps --no-binary :all: llama-cpp-python" in out
    assert "-DLLAMA_BUILD_SERVER=ON" in out


def test_vs_llamacpp_table_takes_medians_and_ratios_per_round():
    import vs_llamacpp

    def summary(tok_s, ttft, itl):
        return {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": ttft},
                "itl_ms": {"p50": itl, "mean": itl}}  # fmt: skip

    rounds = [
        {"minisgl": {1: summary(100, 50, 10)}, "llama.cpp": {1: summary(50, 25, 20)}},
        {"minisgl": {1: summary(90, 60, 12)}, "llama.cpp": {1: summary(60, 30, 12)}},
        {"minisgl": {1: summary(80, 40, 8)}, "llama.cpp": {1: summary(40, 40, 16)}},
    ]
    rows = {r["metric"]: r for r in vs_llamacpp.table(rounds, [1])}
    tok = rows["output tok/s"]
    assert (tok["minisgl"], tok["llama.cpp"]) == (90, 50)
    assert tok["ratios"] == [2.0, 1.5, 2.0] and tok["ratio"] == 2.0
    assert rows["ITL p50 (ms)"]["ratio"] == 0.5 and not rows["ITL p50 (ms)"]["higher_is_better"]
