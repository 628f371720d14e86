"""minisgl against llama.cpp's `llama-server` on the same GGUF file, side by side.

Both servers run on this machine one at a time (never together), each on a free port, and
the same client (online.py's: streaming chat completions over httpx, random common-word
prompts of about `--input-len` tokens, `max_tokens = --output-len` with `ignore_eos`,
greedy) sends the same workload at each `--concurrency` (default 1 and 16). Per round the
two servers alternate (minisgl first in odd rounds, llama.cpp first in even ones), and the
table gives each figure's median over `--rounds` with the ratio minisgl / llama.cpp:
output tokens/s (higher is better), TTFT and inter-token latency p50 (lower is better).

The GGUF is the embedded default model's unless `--gguf PATH` names another one (minisgl
then serves it with `--model PATH`); minisgl runs as `make run` starts it (its default
`--quantization gguf`) plus any `--minisgl-arg`. llama-server runs with `-t --threads`
(default: every core), `-np` = the highest concurrency (one slot per stream) and a
context of that many times the request length.

`llama-server` comes from PATH or `--llama-server PATH`. Without one the script says how
to build it and exits 0 (skipped). Build it from the llama-cpp-python source distribution
on PyPI (its vendored llama.cpp), outside this repository:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llama
    cd /tmp/llama && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2     # build/bin/llama-server

If the binary then dies with "Illegal instruction" (a VM whose CPU flags promise more than
it runs, e.g. AVX-512 FP16), configure it for named instruction sets instead of the host's:
add -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON (the AVX-512 ones only where the CPU has them).

    python benchmarks/vs_llamacpp.py --llama-server /tmp/llama/.../build/bin/llama-server
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import online
from common import add_quiet_flags, launched_minisgl, quiet_first, script_parser, write_json

BUILD_HINT = __doc__[__doc__.index("Build it from") : __doc__.index("    python benchmarks/")]


def find_llama_server(path: str | None) -> str | None:
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("llama-server")


@contextmanager
def llama_server(binary: str, gguf: Path, threads: int, slots: int, ctx: int, timeout: float):
    """`llama-server` on a free port, in its own process group, its log in a temp file;
    yielded once healthy (`.base_url`, `.proc`), stopped after."""
    from minisgl.testing.server import wait_healthy
    from minisgl.utils.process import free_port

    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-np", str(slots), "-c", str(ctx), "--jinja"]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = SimpleNamespace(base_url=f"http://127.0.0.1:{port}", proc=proc)
        try:
            if not wait_healthy(server.base_url, lambda: proc.poll() is not None, timeout):
                tail = Path(log.name).read_text()[-2000:]
                raise SystemExit(f"llama-server exited or not healthy after {timeout} s: {tail}")
            yield server
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def one_round(args, binary: str, gguf: Path, order: list[str]) -> dict[str, dict[int, dict]]:
    """Each server in `order` started, measured at every concurrency (online.py's workload:
    a warm-up request, then the timed load), and stopped."""
    out: dict[str, dict[int, dict]] = {}
    top = max(args.concurrency)
    for name in order:
        quiet_first(args)
        if name == "minisgl":
            env = {"OMP_NUM_THREADS": str(args.minisgl_threads)} if args.minisgl_threads else None
            server = launched_minisgl(str(args.gguf) if args.gguf else None, *args.minisgl_arg,
                                      env=env, timeout=args.launch_timeout)  # fmt: skip
        else:
            ctx = top * (args.input_len + args.output_len + 128)
            server = llama_server(binary, gguf, args.threads, top, ctx, args.launch_timeout)
        with server as srv:
            loads = {c: online.Load(srv.base_url, args.requests_per_stream * c, c,
                                    input_len=args.input_len, output_len=args.output_len,
                                    seed=args.seed, timeout=args.timeout, server_pgid=srv.proc.pid)
                     for c in args.concurrency}  # fmt: skip
            out[name] = {c: online.run(load) for c, load in loads.items()}
        for c, s in out[name].items():
            print(
                f"  {name:9s} c={c:<3d} {s['output_tokens_per_s']:7.1f} tok/s  TTFT p50 "
                f"{s['ttft_ms']['p50']:8.1f} ms  ITL p50 {s['itl_ms']['p50']:6.1f} ms  "
                f"(failed {s['requests_failed']}, others {s['cpu']['others_cores']:.2f} cores)",
                file=sys.stderr,
            )
    return out


METRICS = [  # (label, how to read it from a summary, higher is better)
    ("output tok/s", lambda s: s["output_tokens_per_s"], True),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"], False),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"], False),
    ("ITL mean (ms)", lambda s: s["itl_ms"]["mean"], False),
]


def table(rounds: list[dict], concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        for label, get, higher in METRICS:
            ours = statistics.median(get(r["minisgl"][c]) for r in rounds)
            theirs = statistics.median(get(r["llama.cpp"][c]) for r in rounds)
            ratios = [get(r["minisgl"][c]) / get(r["llama.cpp"][c]) for r in rounds]
            rows.append(
                {
                    "concurrency": c,
                    "metric": label,
                    "minisgl": ours,
                    "llama.cpp": theirs,
                    "ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "higher_is_better": higher,
                }  # fmt: skip
            )
    return rows


def print_table(rows: list[dict], n_rounds: int) -> None:
    print(f"\nmedians over {n_rounds} round(s); ratio = minisgl / llama.cpp (median of rounds)")
    print("| streams | metric | minisgl | llama.cpp | ratio |\n|---:|---|---:|---:|---:|")
    for r in rows:
        better = "higher is better" if r["higher_is_better"] else "lower is better"
        print(
            f"| {r['concurrency']} | {r['metric']} | {r['minisgl']:.1f} | {r['llama.cpp']:.1f} "
            f"| {r['ratio']:.2f} ({better}) |"
        )


def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--llama-server", default=None, help="the binary (default: from PATH)")
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded model's")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--requests-per-stream", type=int, default=2, help="requests = this x concurrency"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="both servers once per round")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    p.add_argument("--minisgl-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for minisgl (default: its own choice)")  # fmt: skip
    p.add_argument("--minisgl-arg", action="append", default=[], metavar="ARG",
                   help="extra minisgl flag (repeatable)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--launch-timeout", type=float, default=600.0)
    add_quiet_flags(p, timeout=120.0)  # before each server
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    binary = find_llama_server(args.llama_server)
    if binary is None:
        where = args.llama_server or "PATH"
        print(f"skipped: no llama-server binary ({where}). {BUILD_HINT}")
        return 0
    if args.gguf is None:
        from minisgl.models.default_model import find_default_gguf

        gguf = find_default_gguf()
    else:
        gguf = args.gguf.resolve()
    print(f"{gguf.name}: minisgl against {binary}", file=sys.stderr)
    rounds = []
    for i in range(args.rounds):
        order = ["minisgl", "llama.cpp"] if i % 2 == 0 else ["llama.cpp", "minisgl"]
        print(f"round {i + 1}/{args.rounds}: {' then '.join(order)}", file=sys.stderr)
        rounds.append(one_round(args, binary, gguf, order))
    rows = table(rounds, args.concurrency)
    print_table(rows, len(rounds))
    if args.json:
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "gguf": str(gguf),
                  "llama_server": binary, "rows": rows, "rounds": rounds}  # fmt: skip
        write_json(args.json, record)
    failed = sum(s["requests_failed"] for r in rounds for srv in r.values() for s in srv.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
