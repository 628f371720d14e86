"""benchmarks/first_contact.py's dry run on the CPU: the same steps, at small shapes, under
limits of seconds, as CI can run it. One run, with the `attention` step rehearsing a hang
(it ignores SIGINT), must stay within the 8 files a lent GPU machine returns, put every
step in steps.jsonl, cut the hung step with SIGINT then SIGKILL, check the device after
it, and still run the steps after it.

The run takes about a minute on two busy cores: which of the last steps fit in its
deadline depends on the machine, so only the first ones must pass; every step must end
with a status and the run within its deadline (timing is not asserted beyond that bound).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["env", "attention", "engine", "overlap", "throughput", "gpu_tests", "offline", "doctor"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list[dict]]:
    out = tmp_path_factory.mktemp("first-contact")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/first_contact.py", "--dry-run", "--hang", "attention",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return proc, out, lines


def _end(lines: list[dict], step: str) -> dict:
    ends = [x for x in lines if x["step"] == step and x["event"] == "end"]
    assert len(ends) == 1, f"{step}: {ends}"
    return ends[0]


def test_the_dry_run_writes_at_most_eight_files_and_every_step(dry_run) -> None:
    import first_contact

    proc, out, lines = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and set(files) <= set(first_contact.FILES), files
    assert {"steps.jsonl", "run.log", "summary.md"} <= set(files)
    for step in ["setup", *STEPS]:
        assert _end(lines, step)["status"] in {"ok", "failed", "timeout", "skipped"}
    run_end = _end(lines, "run")
    assert run_end["seconds"] <= 60 + 2 * 1.0  # the dry run's deadline, and its kill wait
    assert proc.returncode == 1  # the rehearsed hang is not ok
    summary = (out / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} |" in summary


def test_a_hung_step_is_cut_and_the_steps_after_it_still_run(dry_run) -> None:
    _, out, lines = dry_run
    hung = _end(lines, "attention")
    assert hung["status"] == "timeout" and hung["signals"] == ["SIGINT", "SIGKILL"]
    assert hung["limit_s"] == 3 and hung["rc"] == -9 and hung["tail"] == ["hanging"]
    after = _end(lines, "attention: device after")
    assert after["status"] == "ok"
    probe = [x["record"] for x in lines if x["step"] == "attention: device after" and "record" in x]
    assert probe == [{"device_ok": True, "device": "cpu", "free_gib": None}]
    # the steps after it ran: the engine started, with its start-up line recorded
    assert _end(lines, "engine")["status"] == "ok"
    engine = next(x["record"]["engine"] for x in lines if x["step"] == "engine" and "record" in x)
    assert engine["startup_line"].startswith("engine ready:")
    assert engine["self_check"].startswith("self-check: 3/3 checks passed")
    assert "[attention] hanging" in (out / "run.log").read_text()


def test_the_first_steps_record_what_they_found(dry_run) -> None:
    _, _, lines = dry_run
    assert _end(lines, "env")["status"] == "ok"
    env = next(x["record"]["environment"] for x in lines if x["step"] == "env" and "record" in x)
    assert env["device"]["type"] == "cpu" and env["torch"]
    starts = [x["step"] for x in lines if x["event"] == "start"]
    assert starts[:3] == ["run", "env", "attention"]  # in the order of the plan
    for x in lines:
        if x["event"] == "end" and x.get("status") == "skipped":
            assert x["reason"]


def test_the_steps_name_every_file_that_holds_gpu_tests() -> None:
    import first_contact

    names = {p.name for p in first_contact.gpu_test_files()}
    assert {"test_triton_attention.py", "test_selfcheck.py", "test_staging.py"} <= names
    gpu_step = next(s for s in first_contact.plan(False, Path("/tmp")) if s.name == "gpu_tests")
    assert all(f"tests/unit/{n}" in gpu_step.argv for n in names)
