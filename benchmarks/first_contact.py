"""First contact with a lent GPU: what works there, and how fast, within one short command.

A lent machine gives about 15 minutes of device time in all, at most 10 per command, and
brings back at most 8 files. So: each step runs in a process of its own under its own time
limit (SIGINT first, which makes Python print where it hung, then SIGKILL), every result is
appended to one JSON-lines file the moment it exists, and the whole run ends by `--deadline`
(420 s; 60 s for a dry run), which leaves time to run it again inside a second command. The steps, in order of
what they tell per second:

1. `setup`: the wheels carried in .whl/ (`make gpu-wheels`: msgspec) installed aside;
2. `env`: device, memory, driver and versions (first_contact_steps.py, as the next four);
3. `attention`: the Triton attention kernels at Qwen3-0.6B's shape, bfloat16 and float16;
4. `engine`: an engine at Qwen3-0.6B's real configuration (pool sized from free memory,
   every graph bucket captured, the start-up self-check on): its start-up line and the
   memory before and after the capture;
5. `overlap`: overlapped steps against synchronous ones, on the same engine;
6. `throughput`: prefill and decode tokens per second, CUDA graphs on and off;
7. `gpu_tests`: the tests marked `gpu`, run by naming the files that hold them (collecting
   all of tests/unit needs the server's packages, which that machine lacks);
8. `offline`: the offline benchmark at full size, our engine alone (`--baseline none`);
9. `doctor`: `python -m minisgl doctor --jsonl`, each check a line as it completes.
A step that fails or is cut is followed by `<step>: device after`, a tiny computation in a
fresh process: a sticky CUDA error or a kernel still running shows there, and the steps
after it still run, each in a fresh process.

Files, in `--out` (default $OUT, else ./gpu-results), and no others (FILES):
`steps.jsonl` (per step a `start` line, its results as `record` lines, an `end` line with
status ok / failed / timeout / skipped, seconds, the signals sent, the last lines of output
and the first CUDA error seen), `run.log` (every line each step printed), `summary.md`
(results_table.py's table of steps.jsonl, rewritten after each step) and `offline.json`.

    python3 benchmarks/first_contact.py                  # on the GPU machine
    python3 benchmarks/first_contact.py --dry-run        # here: the same steps on the CPU,
                                                         # small shapes, limits of seconds

The runner itself imports nothing but the standard library (and results_table.py), so a
crash of torch or of the driver ends a step, never the run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import results_table

ROOT = Path(__file__).resolve().parents[1]
FILES = ("steps.jsonl", "run.log", "summary.md", "offline.json")  # the device tool brings 8
SITE = "/tmp/minisgl-site"  # where the carried wheels are installed
# the first line of these in a step's output is its `cuda_error`
CUDA_ERROR = re.compile(
    r"CUDA error|illegal memory access|device-side assert|unspecified launch failure|"
    r"CUBLAS_STATUS_|cudaError|AcceleratorError|misaligned address|an illegal instruction"
)
TAIL_LINES = 15


@dataclass
class Step:
    name: str
    argv: list[str]  # run from the repository root
    limit_s: float
    after: str | None = None  # a figure file of FILES the step writes, recorded when it ends
    env: dict[str, str] = field(default_factory=dict)


def plan(dry: bool, out: Path) -> list[Step]:
    """The steps, in order. Limits on a GPU add up to more than the deadline: a step gets
    what is left when it starts, and the last ones are the least informative."""
    py = sys.executable
    steps_py = [py, "benchmarks/first_contact_steps.py"]
    dry_flag = ["--dry-run"] if dry else []
    offline = ["--config", "qwen3-0.6b", "--dummy-weights"]
    if dry:
        offline = ["--config", "llama-60m", "--dummy-weights", "--device", "cpu",
                   "--num-seqs", "4", "--min-len", "8", "--max-len", "16", "--no-warmup"]  # fmt: skip
    gpu_files = [str(p.relative_to(ROOT)) for p in gpu_test_files()]
    doctor = ["--probe-seconds", "0" if dry else "4"]
    # (name, argv, GPU limit, dry-run limit)
    table = [
        ("env", [*steps_py, "env", *dry_flag], 30, 15),
        ("attention", [*steps_py, "attention", *dry_flag], 45, 15),
        ("engine", [*steps_py, "engine", *dry_flag], 75, 15),
        ("overlap", [*steps_py, "overlap", *dry_flag], 60, 15),
        ("throughput", [*steps_py, "throughput", *dry_flag], 60, 15),
        (
            "gpu_tests",
            [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *gpu_files],
            90,
            25,
        ),  # fmt: skip
        (
            "offline",
            [
                py,
                "benchmarks/offline.py",
                *offline,
                "--baseline",
                "none",
                "--json",
                str(out / "offline.json"),
            ],
            75,
            20,
        ),  # fmt: skip
        ("doctor", [py, "-m", "minisgl", "doctor", "--jsonl", *doctor], 150, 8),
    ]
    steps = [Step(n, argv, dry_s if dry else gpu_s) for n, argv, gpu_s, dry_s in table]
    steps[6].after = "offline.json"
    if dry:  # as the doctor and the tests do on a CPU: kernels in Triton's interpreter
        for s in steps:
            s.env["TRITON_INTERPRET"] = "1"
    return steps


def gpu_test_files() -> list[Path]:
    """The test files holding tests marked `gpu` (each imports only what the GPU machine has;
    tests/unit/test_gpu_collection.py checks that)."""
    return sorted(
        p for p in (ROOT / "tests" / "unit").glob("test_*.py") if "mark.gpu" in p.read_text()
    )


class Run:
    """One run: the deadline, the JSON-lines file, the log, and each step's process."""

    def __init__(self, out: Path, deadline_s: float, grace_s: float, env: dict[str, str]):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.grace_s, self.env = out, grace_s, env
        self.min_step_s = 3 * grace_s  # less is not worth a start (torch alone takes seconds)
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.jsonl = open(out / "steps.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self.log = open(out / "run.log", "a", encoding="utf-8")  # noqa: SIM115

    def now(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def record(self, step: str, event: str, **fields) -> None:
        line = {"step": step, "event": event, "t": self.now(), **fields}
        self.jsonl.write(json.dumps(line) + "\n")
        self.jsonl.flush()

    def say(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()
        print(text, flush=True)

    def step(self, step: Step) -> str:
        """Run one step under its limit; its status (ok, failed, timeout, skipped)."""
        # what is left, less the grace a cut step gets after SIGINT and after SIGKILL
        limit = min(step.limit_s, self.deadline - time.monotonic() - 3 * self.grace_s)
        if limit < self.min_step_s:
            self.record(step.name, "end", status="skipped", reason="no time left")
            self.say(f"[{step.name}] skipped: no time left before the deadline")
            return "skipped"
        self.record(step.name, "start", limit_s=round(limit, 1), argv=step.argv)
        self.say(f"[{step.name}] start (limit {limit:.0f} s): {' '.join(step.argv)}")
        started = time.monotonic()
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        cuda_error: list[str] = []
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env={**self.env, **step.env}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,  # its own process group: the signals reach its children
        )  # fmt: skip

        def read() -> None:
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                self.log.write(f"[{step.name}] {line}\n")
                self.log.flush()
                tail.append(line[:500])
                if not cuda_error and CUDA_ERROR.search(line):
                    cuda_error.append(line[:500])
                if line.startswith("{"):
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self.record(step.name, "record", record=obj)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        signals: list[str] = []
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
            # a process in an uninterruptible driver call outlives even SIGKILL: after the
            # second wait the run goes on without it (its `rc` is then null)
            for sig, wait in ((signal.SIGINT, self.grace_s), (signal.SIGKILL, 2 * self.grace_s)):
                signals.append(sig.name)
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        reader.join(timeout=5)  # a grandchild that left the group may hold the pipe
        seconds = round(time.monotonic() - started, 2)
        status = "timeout" if signals else "ok" if rc == 0 else "failed"
        if step.after and (figure := self.out / step.after).exists():
            try:
                self.record(
                    step.name, "record", record={step.after: json.loads(figure.read_text())}
                )
            except ValueError:
                pass
        self.record(
            step.name, "end", status=status, rc=proc.returncode, seconds=seconds,
            limit_s=round(limit, 1), signals=signals, cuda_error=cuda_error[0] if cuda_error else None,
            tail=list(tail),
        )  # fmt: skip
        cut = f", cut by {' then '.join(signals)}" if signals else ""
        self.say(f"[{step.name}] {status} in {seconds:.1f} s (exit {proc.returncode}{cut})")
        return status

    def summary(self) -> None:
        table = results_table.table(self.out / "steps.jsonl")
        (self.out / "summary.md").write_text(table + "\n", encoding="utf-8")

    def close(self) -> None:
        self.jsonl.close()
        self.log.close()


def device_after(step: str, dry: bool) -> Step:
    """A tiny computation on the device in a fresh process, after `step` failed or was cut:
    does the device still compute, or did the step leave it broken or busy?"""
    code = (
        f"import json, torch; d = 'cpu' if {dry} else 'cuda'; "
        "x = torch.ones(1, device=d).add_(1).item(); "
        "torch.cuda.synchronize() if d == 'cuda' else None; "
        "free = torch.cuda.mem_get_info()[0] / 2**30 if d == 'cuda' else None; "
        "print(json.dumps({'device_ok': x == 2.0, 'device': d, 'free_gib': free}))"
    )
    return Step(f"{step}: device after", [sys.executable, "-c", code], 15 if dry else 30)


def setup(run: Run, dry: bool) -> None:
    """The wheels in .whl/ installed aside (SITE), put first on the steps' PYTHONPATH."""
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        reason = "no wheels in .whl/ (make gpu-wheels fetches them)"
        run.record("setup", "end", status="skipped", reason=reason)
        run.say(f"[setup] skipped: {reason}")
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *wheels]  # fmt: skip
    if run.step(Step("setup", pip, 60)) == "ok":
        run.env["PYTHONPATH"] = os.pathsep.join([SITE, run.env["PYTHONPATH"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, small")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run (default 420; 60 with --dry-run)")  # fmt: skip
    p.add_argument(
        "--hang",
        metavar="STEP",
        default=None,
        help="rehearse a hung step: STEP sleeps, ignoring SIGINT, under a 3 s limit",
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    deadline = args.deadline if args.deadline is not None else 60 if args.dry_run else 420
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"  # small shapes; the machine may be shared
        env.pop("MINISGL_INJECT_FAULTS", None)
    run = Run(out, deadline, grace_s=1.0 if args.dry_run else 5.0, env=env)
    steps = plan(args.dry_run, out)
    if args.hang:
        hang = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        hang += "print('hanging', flush=True); time.sleep(3600)"
        for s in steps:
            if s.name == args.hang:
                s.argv, s.limit_s = [sys.executable, "-c", hang], 3
    run.say(f"first contact: {'dry run on the CPU' if args.dry_run else 'GPU'}, "
            f"deadline {deadline:.0f} s, results in {out}")  # fmt: skip
    run.record("run", "start", dry_run=args.dry_run, deadline_s=deadline, commit=_commit())
    statuses = {}
    try:
        setup(run, args.dry_run)
        for step in steps:
            statuses[step.name] = run.step(step)
            if statuses[step.name] in ("failed", "timeout"):
                run.step(device_after(step.name, args.dry_run))
            run.summary()
    finally:
        run.record("run", "end", seconds=run.now(), statuses=statuses)
        run.summary()
        run.close()
    print((out / "summary.md").read_text(encoding="utf-8"))
    return 0 if all(s == "ok" for s in statuses.values()) else 1


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
