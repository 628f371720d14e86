"""What the benchmark scripts share: their argument parser (`script_parser`, with `--json`;
`model_parser` adds the model and engine flags), CPU accounting from Linux's /proc
(`cpu_snapshot` / `cores_used`), waiting for a quiet machine (`--quiet-limit`), a launched
minisgl server, what engine ran (`describe`, `engine_record`), nearest-rank percentiles,
the model configs shipped in benchmarks/configs/, and writing a result file.

Contract:
- standard library only at import (minisgl's configurations, torch and the test harness
  are imported where used), so every script can import it, also on a GPU machine that has
  nothing but the package's own dependencies;
- the engine flags a script takes are minisgl's own (`add_engine_flags`): their names,
  help and choices are declared once, on the configuration fields;
- the /proc readings return nan where /proc is missing or unreadable, never raise;
- `wait_quiet` prints nothing: it returns the last reading, and the caller says, in its
  own report, that it measures on a busy machine (`quiet_first` says it on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"


# ---------------------------------------------------------------------------- arguments
def script_parser(doc: str, *json_flags: str, parser_class=argparse.ArgumentParser, **kw):
    """A script's parser: the first paragraph of its docstring as the description, the
    defaults shown in --help, and `--json PATH` (or `json_flags`) for the result file."""
    p = parser_class(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        **kw,
    )
    p.add_argument(*(json_flags or ("--json",)), dest="json", default=None, metavar="PATH",
                   help="write the results here as JSON")  # fmt: skip
    return p


def add_quiet_flags(p, limit: float = 0.0, timeout: float = 600.0) -> None:
    """--quiet-limit / --quiet-timeout, read by `quiet_first`."""
    p.add_argument("--quiet-limit", type=float, default=limit,
                   help="before measuring, wait until the machine's busy CPU is under this %% "
                   "of one core (a shared machine; 0: do not wait)")  # fmt: skip
    p.add_argument("--quiet-timeout", type=float, default=timeout,
                   help="seconds to wait for a quiet machine before measuring anyway")  # fmt: skip


def quiet_first(args: argparse.Namespace) -> float:
    """`wait_quiet` as --quiet-limit asks (nan: no wait); says so on stderr when the machine
    stayed busy, since what follows is then measured beside other work."""
    if args.quiet_limit <= 0:
        return float("nan")
    busy = wait_quiet(args.quiet_limit, args.quiet_timeout)
    if busy > args.quiet_limit:
        print(f"  (other processes use {busy:.0f}% CPU; measuring anyway)", file=sys.stderr)
    return busy


# ---------------------------------------------------------------------------- CPU use
def _ticks_to_seconds(ticks: float) -> float:
    return ticks / os.sysconf("SC_CLK_TCK")


def _proc_stat(path: Path) -> list[str]:
    """The fields of a /proc/<pid>/stat after the command name (which may hold spaces):
    [0] state, [2] process group, [11] user ticks, [12] system ticks."""
    return path.read_text().rsplit(")", 1)[1].split()


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, all cores and all processes: every
    column of /proc/stat's `cpu` line up to steal, less idle and iowait."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return _ticks_to_seconds(sum(ticks[:8]) - idle)
    except (OSError, ValueError, IndexError):
        return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, all its threads."""
    try:
        fields = _proc_stat(Path(f"/proc/{pid}/stat"))
        return _ticks_to_seconds(int(fields[11]) + int(fields[12]))
    except (OSError, IndexError, ValueError):
        return float("nan")


def group_cpu_seconds(pgid: int | None) -> float:
    """User + system CPU seconds of every live process in one process group (a launched
    server and its workers); nan without a group."""
    if pgid is None:
        return float("nan")
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _proc_stat(stat)
            if int(fields[2]) == pgid:
                ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):  # a process that exited meanwhile
            continue
    return _ticks_to_seconds(ticks)


def cpu_snapshot(pgid: int | None = None) -> dict[str, float]:
    """CPU seconds so far of the whole machine, of this process (with its children that were
    waited for: tensor-parallel ranks) and of process group `pgid` (nan without one)."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return {"t": time.perf_counter(), "machine": machine_busy_seconds(), "own": own,
            "group": group_cpu_seconds(pgid)}  # fmt: skip


def cores_used(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Cores used on average between two `cpu_snapshot`s: the machine, this process, the
    group, and `others`, everything else (other work on a shared machine skews a figure)."""
    seconds = b["t"] - a["t"]
    used = {k: (b[k] - a[k]) / seconds for k in ("machine", "own", "group")}
    group = 0.0 if math.isnan(used["group"]) else used["group"]
    used["others"] = used["machine"] - used["own"] - group
    return used


def wait_quiet(limit_pct: float, timeout: float) -> float:
    """On a shared machine: wait until the machine's busy CPU (the benchmark's own
    processes idle meanwhile) stays under `limit_pct` of one core for a second, at most
    about `timeout` seconds. Returns the last reading in % of one core (nan: no /proc, so
    no wait); above `limit_pct` when the wait timed out."""
    deadline = time.monotonic() + timeout
    while True:
        a, t = machine_busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        busy = 100 * (machine_busy_seconds() - a) / (time.perf_counter() - t)
        if busy <= limit_pct or math.isnan(busy) or time.monotonic() > deadline:
            return busy
        time.sleep(2.0)


# ---------------------------------------------------------------------------- models
def add_engine_flags(p, *names: str, **defaults) -> None:
    """The engine's and the scheduler's flags named (by field: "page_size", ...), generated
    from their fields' declarations as `python -m minisgl` has them (name, help, choices);
    `defaults` are the script's own where it differs from minisgl's."""
    from minisgl.engine.config import EngineConfig
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.utils.flags import add_flags

    for cls in (EngineConfig, SchedulerConfig):
        add_flags(p, cls, only=names, **defaults)


def engine_options(args: argparse.Namespace, *names: str) -> dict:
    """The parsed values of those flags, as `LLM(**options)` takes them."""
    return {name: getattr(args, name) for name in names}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model or --config (resolved by `resolve_model`) and --dummy-weights."""
    src = p.add_mutually_exclusive_group()
    add_engine_flags(src, "model")
    src.add_argument(
        "--config",
        default=None,
        help="a config shipped in benchmarks/configs/ "
        "(e.g. qwen3-0.6b): a config-only folder, so random weights",
    )
    add_engine_flags(p, "dummy_weights")


class _ModelParser(argparse.ArgumentParser):
    def __init__(self, *a, default_config: str | None = None, **kw) -> None:
        super().__init__(*a, **kw)
        self.default_config = default_config

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        if parsed.model is None and parsed.config is None:
            parsed.config = self.default_config
        resolve_model(self, parsed)
        return parsed


def model_parser(doc: str, *engine_flags: str, default_config: str | None = None, **defaults):
    """`script_parser` for a script that builds an engine: --model / --config /
    --dummy-weights and minisgl's own `engine_flags` (`add_engine_flags`, `defaults` its
    own where it differs); parse_args resolves --config (`resolve_model`), or
    `default_config` when neither --model nor --config is given."""
    p = script_parser(doc, parser_class=_ModelParser, default_config=default_config)
    add_model_args(p)
    add_engine_flags(p, *engine_flags, **defaults)
    return p


def resolve_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--config NAME`: `args.model` becomes that folder and `args.dummy_weights` is set
    (the folder holds no weights); an unknown NAME is a usage error listing the shipped ones."""
    if args.config is None:
        return
    folder = CONFIGS / args.config
    if not (folder / "config.json").is_file():
        names = sorted(d.name for d in CONFIGS.iterdir() if (d / "config.json").is_file())
        p.error(f"no config {args.config!r}; shipped: {', '.join(names)}")
    args.model, args.dummy_weights = str(folder), True


# ---------------------------------------------------------------------------- servers
@contextmanager
def launched_minisgl(model, *flags: str, device: str = "cpu", env=None, timeout=600.0):
    """`python -m minisgl` on a free port (the tests' `RunningServer`, in its own process
    group), log level warning; yields it once healthy, and stops it after with SIGINT (abort
    what is left, stop the workers). Its log is kept, and named, only when something failed."""
    import signal

    from minisgl.testing.server import RunningServer

    server = RunningServer(model, "--log-level", "warning", *flags, env=env, device=device,
                           wait=False)  # fmt: skip
    ok = False
    try:
        try:
            server.wait_healthy(timeout)
        except RuntimeError as exc:
            raise SystemExit(f"the launched {exc}") from None
        yield server
        ok = True
    finally:
        server.stop(signal.SIGINT)
        if ok:
            server.log_path.unlink(missing_ok=True)
        else:
            print(f"server log: {server.log_path}", file=sys.stderr)


def engine_record(engine) -> dict:
    """What ran, for a result file: the model folder's name, device, dtype, weights,
    attention backend, KV pages, CUDA graphs, native decode steps (their kernel's
    name, or None) and tensor-parallel size of an `Engine`."""
    graphs = engine.graph_runner is not None and bool(engine.graph_runner.graphs)
    native = engine.runner.native
    return {"model": engine.model_dir.name, "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.quantization,
            "attention_backend": type(engine.attn_backend).__name__,
            "num_pages": engine.num_pages, "page_size": engine.page_size,
            "cuda_graphs": graphs, "native_decode": native.kernel if native is not None else None,
            "tp_size": engine.tp.size}  # fmt: skip


def describe(engine) -> str:
    """`engine_record` as the one line a script prints first."""
    r = engine_record(engine)
    tp = f", tensor parallel over {r['tp_size']} ranks" if r["tp_size"] > 1 else ""
    return (f"{r['model']} on {r['device']} ({r['dtype']}, weights {r['quantization']}, "
            f"{r['attention_backend']}, {r['num_pages']} KV pages of {r['page_size']}, "
            f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}, "
            f"native decode {r['native_decode'] or 'off'}{tp})")  # fmt: skip


def cuda_sync(device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): timings end with it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- results
def percentiles(values, ps=(50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (no interpolation) and the mean of seconds, in milliseconds."""
    if not values:
        return {f"p{p}": None for p in ps} | {"mean": None}
    s = sorted(values)
    out = {f"p{p}": 1000 * s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] for p in ps}
    out["mean"] = 1000 * statistics.fmean(s)
    return out


def write_json(path: str | Path, record: dict) -> None:
    """A result file: the record as indented JSON."""
    Path(path).write_text(json.dumps(record, indent=2) + "\n")
