"""`python -m minisgl doctor` on the CPU, as CI runs it: its JSON, its exit status, and that
it needs none of the server's dependencies.

The whole doctor runs once in a subprocess in which FastAPI, uvicorn, pydantic, starlette
and pyzmq cannot be imported (what the GPU machine of benchmarks/first_contact.py lacks), with
the Triton kernels in Triton's interpreter; once more without triton, where it checks the
torch backend and says what it could not. An in-process run at one shape with a fault
injected into the engine's Triton backend must fail, exit 1 and name the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import faults
import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("fastapi", "uvicorn", "pydantic", "starlette", "zmq")


def _doctor(*args: str, unimportable=SERVER_ONLY) -> tuple[int, dict, str]:
    """`python -m minisgl doctor ARGS` in a subprocess where `unimportable` cannot be
    imported; (exit status, its JSON, its stderr)."""
    prelude = f"""
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {tuple(unimportable)!r}:
            raise ImportError(f"{{name}} is not installed on this machine")
sys.meta_path.insert(0, Block())
sys.argv = ["minisgl", *sys.argv[1:]]
runpy.run_module("minisgl", run_name="__main__", alter_sys=True)
"""
    # one torch thread: two threads spin-waiting on a shared two-core machine run many
    # times slower, and no figure of these runs is asserted
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MINISGL_INJECT_FAULTS", None)
    proc = subprocess.run(
        [sys.executable, "-c", prelude, "doctor", "--json", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def doctor_run() -> tuple[int, dict, str]:
    return _doctor("--probe-seconds", "1")


def test_doctor_json_has_the_fixed_shape_and_every_shape_passes(doctor_run) -> None:
    rc, doc, stderr = doctor_run
    assert rc == 0, stderr[-3000:]
    assert doc["passed"] is True
    assert {"checks", "not_checked", "environment", "throughput", "passed"} <= set(doc)
    checks = doc["checks"]
    names = [c["name"] for c in checks]
    assert len(names) == len(set(names))
    for c in checks:
        assert {"name", "passed", "max_error", "tolerance", "detail", "part", "group"} <= set(c)
        assert c["passed"] is True and c["max_error"] is not None
        assert c["max_error"] <= c["tolerance"]
    groups = {c["group"] for c in checks}
    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for g in (1, 4, 8):
                for ps in (1, 16):
                    assert f"attention {dtype} D={d} G={g} page={ps}" in groups
    # the torch backend everywhere; Triton (interpreted) wherever the interpreter computes
    assert {"torch decode", "torch prefill", "torch store"} <= {
        c["name"].split(": ")[1] for c in checks
    }
    triton_dtypes = {c["shape"]["dtype"] for c in checks if c["part"] == "triton"}
    skipped = {n["name"] for n in doc["not_checked"]}
    for dtype in ("bfloat16", "float16"):
        assert dtype in triton_dtypes or f"triton {dtype}" in skipped
    decode = next(c for c in checks if c["name"].endswith("triton decode"))
    assert decode["shape"]["batch_sizes"] == [1, 3]


def test_doctor_runs_the_engine_self_check_and_says_what_it_could_not_check(doctor_run) -> None:
    _, doc, _ = doctor_run
    engine = [c for c in doc["checks"] if c["group"].startswith("engine float16")]
    short = [c["name"].split(": ")[1] for c in engine]
    assert short[:3] == ["triton decode", "triton prefill", "triton store"]
    assert {"cuda_graph bs=1", "cuda_graph bs=2", "cuda_graph bs=4", "overlap"} <= set(short)
    skipped = {n["name"]: n["reason"] for n in doc["not_checked"]}
    assert "no CUDA device" in skipped["cuda_graph capture"]
    assert "interpreter" in skipped["triton on a GPU"]
    assert not any(n.startswith("engine") and "import" in r for n, r in skipped.items())
    env = doc["environment"]
    assert env["device"]["type"] == "cpu" and env["triton_interpreter"] is True
    assert env["torch"] and env["triton"]


def test_doctor_measures_prefill_and_decode_throughput(doctor_run) -> None:
    _, doc, _ = doctor_run
    t = doc["throughput"]
    assert t["model"].startswith("SmolLM2-135M shape")
    assert t["prefill"]["tokens_per_s"] > 0 and t["prefill"]["steps"] >= 1
    assert t["decode"]["tokens_per_s"] > 0 and t["decode"]["ms_per_step"] > 0


def test_without_triton_doctor_checks_the_torch_path_and_says_so() -> None:
    rc, doc, stderr = _doctor("--probe-seconds", "0", unimportable=(*SERVER_ONLY, "triton"))
    assert rc == 0, stderr[-3000:]
    assert doc["environment"]["triton"] is None
    assert {c["part"] for c in doc["checks"]} == {"torch", "overlap"}
    assert len({c["group"] for c in doc["checks"]}) == 2 * 2 * 3 * 2 + 2  # grid + 2 engines
    skipped = {n["name"]: n["reason"] for n in doc["not_checked"]}
    assert "triton is not installed or cannot be imported" in skipped["triton"]
    assert skipped["throughput"] == "--probe-seconds 0"


def test_a_fault_makes_doctor_fail_and_name_it(monkeypatch, capsys) -> None:
    from minisgl.doctor import checks, main

    monkeypatch.setenv("MINISGL_SELF_CHECK_ON_CPU", "1")
    monkeypatch.setenv("MINISGL_INJECT_FAULTS", "triton-values")
    faults.install(monkeypatch)
    monkeypatch.setattr(checks, "DTYPES", {"float16": checks.DTYPES["float16"]})
    monkeypatch.setattr(checks, "HEAD_DIMS", (64,))
    monkeypatch.setattr(checks, "GQA_RATIOS", (4,))
    monkeypatch.setattr(checks, "PAGE_SIZES", (16,))
    assert main(["--json", "--probe-seconds", "0"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["throughput"] is None
    failed = [c["name"] for c in doc["checks"] if not c["passed"]]
    assert failed == [
        "engine float16 (4 heads, 2 KV heads, head dim 16): triton decode",
        "engine float16 (4 heads, 2 KV heads, head dim 16): triton prefill",
    ]  # the grid's own backends have no fault; the torch fallback passed
    assert main(["--probe-seconds", "0"]) == 1  # the table says it too
    out = capsys.readouterr().out
    assert "2 of" in out and "checks FAILED" in out and "triton decode: max error" in out


def _small_grid(monkeypatch) -> None:
    from minisgl.doctor import checks

    monkeypatch.setenv("MINISGL_SELF_CHECK_ON_CPU", "1")
    monkeypatch.delenv("MINISGL_INJECT_FAULTS", raising=False)
    monkeypatch.setattr(checks, "DTYPES", {"float16": checks.DTYPES["float16"]})
    monkeypatch.setattr(checks, "HEAD_DIMS", (64,))
    monkeypatch.setattr(checks, "GQA_RATIOS", (4,))
    monkeypatch.setattr(checks, "PAGE_SIZES", (16,))


def test_jsonl_writes_each_check_as_it_completes_and_a_cut_run_keeps_them(
    monkeypatch, capsys
) -> None:
    from minisgl.doctor import main, probe

    _small_grid(monkeypatch)
    assert main(["--jsonl", "--probe-seconds", "0"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert list(lines[0]) == ["environment"] and lines[-1]["passed"] is True
    checks = [line["check"] for line in lines if "check" in line]
    names = [c["name"] for c in checks]
    assert len(names) == len(set(names)) >= 6  # triton and torch at the shape, then the engine
    assert any(n.startswith("engine float16") for n in names)
    skipped = [line["not_checked"]["name"] for line in lines if "not_checked" in line]
    assert "throughput" in skipped and lines[-2] == {"throughput": None}

    def hung(*args):  # what the time limit's SIGINT does to a probe that never returns
        raise KeyboardInterrupt

    monkeypatch.setattr(probe, "run", hung)
    with pytest.raises(KeyboardInterrupt):
        main(["--jsonl", "--probe-seconds", "1"])
    cut = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["check"]["name"] for line in cut if "check" in line] == names
    assert "passed" not in cut[-1]


def test_the_first_contact_table_names_each_failed_check_and_a_cut_step(tmp_path) -> None:
    """benchmarks/results_table.py over first_contact.py's steps.jsonl, as the run writes
    its summary.md after each step."""
    import results_table

    assert "no result (FileNotFoundError)" in results_table.table(tmp_path / "steps.jsonl")
    ok = {"name": "attention bfloat16 D=64 G=1 page=1: triton store", "passed": True,
          "max_error": 0.0, "detail": "..."}  # fmt: skip
    bad = {"name": "engine bfloat16 (...): cuda_graph bs=8", "passed": False, "max_error": 0.4,
           "detail": "8 rows, replayed"}  # fmt: skip
    lines = [
        {"step": "run", "event": "start", "dry_run": False, "commit": "abc1234"},
        {"step": "doctor", "event": "start", "limit_s": 150},
        {"step": "doctor", "event": "record", "record": {"check": ok}},
        {"step": "doctor", "event": "record", "record": {"check": bad}},
        {"step": "doctor", "event": "end", "status": "timeout", "limit_s": 150, "seconds": 151,
         "signals": ["SIGINT"], "cuda_error": "CUDA error: an illegal memory access", "tail": []},
    ]  # fmt: skip
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": "doctor", "ev'  # cut mid-line
    (tmp_path / "steps.jsonl").write_text(text)
    out = results_table.table(tmp_path / "steps.jsonl")
    assert "commit abc1234" in out
    assert "| doctor | timeout (SIGINT at 150 s) | 151 | CUDA error: CUDA error: an illegal" in out
    assert "1/2 checks passed" in out
    assert "| doctor FAILED | engine bfloat16 (...): cuda_graph bs=8: max error 0.4 | |" in out
