"""guidellm, the load generator many people benchmark servers with, against the real server
(the tiny Llama): its default request shape (streamed chat completions with
`stream_options.continuous_usage_stats`, `stop: null`, `ignore_eos`) and its Responses
mode (`request_format=/v1/responses`: streamed, `max_output_tokens`, `instructions`-less
`input` items, `stop: null`, `ignore_eos`), each for a handful of requests, one at a time
and four at once, with zero errors and every output token counted from the usage we
stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import PROTOCOL_SERVER

pytestmark = [pytest.mark.server(PROTOCOL_SERVER), pytest.mark.slow]

REQUESTS, OUTPUT_TOKENS = 6, 16


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/responses"])
def test_guidellm_streaming_benchmark_has_no_errors(
    server, long_context_dir, tmp_path, request_format
):
    out = tmp_path / "benchmarks.json"
    backend = f"kind=openai_http,target={server.base_url},model={server.model_name}"
    cmd = [
        str(Path(sys.prefix) / "bin" / "guidellm"),
        "run",
        "--backend", f"{backend},request_format={request_format}",
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", "1,4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={long_context_dir}",  # no hub here
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert len(benchmarks) == 2  # one stream, then four at once
    for benchmark in benchmarks:
        metrics = benchmark["metrics"]
        assert metrics["request_totals"] == {
            "successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS
        }  # fmt: skip
        counts = metrics["output_token_count"]["successful"]
        assert counts["total_sum"] == REQUESTS * OUTPUT_TOKENS, counts
        assert metrics["request_streaming_iterations_count"]["successful"]["mean"] > 1
