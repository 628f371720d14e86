"""The real server with a fault injected into its fast path: it starts, serves correct
tokens, and says plainly what it fell back from.

Each server runs the tiny Llama with the Triton backend (in Triton's interpreter) and the
start-up self-check on the CPU (`MINISGL_SELF_CHECK_ON_CPU=1`, the seam the CUDA path's
check is tested through), with one fault of `MINISGL_INJECT_FAULTS`: the Triton backend
returning wrong values, the Triton backend raising as a refused kernel does, the decode
graphs' capture raising. /health answers 200 with a `degraded` reason naming the part,
/metrics has `minisgl_engine_fallback{part=...} 1` for it and 0 for the others, the
start-up line says so, and the official client gets the torch backend's greedy tokens.
With --strict-self-check the same fault stops the start with exit status 1 and the reason.
"""

from __future__ import annotations

import faults
import httpx
import pytest

from minisgl import LLM, SamplingParams
from minisgl.server.metrics import FALLBACK_PARTS
from minisgl.testing.server import RunningServer

pytest.importorskip("triton")

FLAGS = ("--attention-backend", "triton", "--max-running-requests", "2", "--page-size", "4",
         "--max-seq-len", "64")  # fmt: skip
PROMPT = [(j * 11) % 500 + 3 for j in range(13)]
NEW = 8


def _env(fault: str) -> dict[str, str]:
    """The server's processes build their engines with `fault` (tests/faults.py)."""
    return {"MINISGL_SELF_CHECK_ON_CPU": "1", **faults.site_env(fault)}


def _fallbacks(server: RunningServer) -> dict[str, float]:
    body = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    values = {}
    for line in body.splitlines():
        if line.startswith("minisgl_engine_fallback{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.split('part="')[1].split('"')[0]] = float(value)
    return values


@pytest.fixture(scope="module")
def want(tiny_dirs) -> str:
    llm = LLM(str(tiny_dirs["llama"]), device="cpu", page_size=4, max_seq_len=64)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=NEW, ignore_eos=True))
    return out.text


@pytest.mark.parametrize(
    ("fault", "part", "why"),
    [
        ("triton-values", "triton", "max error"),
        ("triton-compile", "triton", "CompilationError"),
        ("graph-capture", "cuda_graph", "operation not permitted when stream is capturing"),
    ],
)
def test_a_broken_part_is_reported_and_routed_around(start_server, want, fault, part, why):
    server = start_server("llama", *FLAGS, env=_env(fault))
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and list(body["degraded"]) == [part]
    assert why in body["degraded"][part] and "serving with" in body["degraded"][part]

    fallbacks = _fallbacks(server)
    assert fallbacks == {p: float(p == part) for p in FALLBACK_PARTS}

    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    server.wait_zero(2.0)

    log = server.log()
    assert f"degraded: fell back from {part}" in log  # the serving line
    assert "self-check failed" in log and why in log


def test_strict_self_check_refuses_to_start_with_the_reason(start_server):
    with pytest.raises(RuntimeError) as failed:
        start_server("llama", *FLAGS, "--strict-self-check", env=_env("triton-values"))
    message = str(failed.value)
    assert "server exited with 1" in message
    assert "self-check failed (--strict-self-check): triton decode: max error" in message


def test_without_a_fault_health_has_no_degraded_field(start_server):
    server = start_server("llama", *FLAGS[2:], env=_env(""))  # torch: the check is quick
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}
    assert set(_fallbacks(server).values()) == {0.0}
    assert "self-check: 3/3 checks passed" in server.log()
