"""Host overhead per decode step: where one scheduler step's time goes, phase by phase.

What it measures: with a model so small that compute is negligible (by default the
shipped qwen3-0.6b config cut to `--layers 2`, random weights), B requests (`--batch-sizes`,
default 1 64 256) are admitted, prefilled, decoded `--warmup` untimed steps, then `--steps`
timed decode steps of all B at once. Every timed step is one pass of the scheduler's process
loop as `Scheduler.run_forever` runs it (receive, then `step()`), driven here in-process as
`minisgl.llm` drives it, and is split into:

- receive: the loop over `process_msg` for the messages that arrived for the step (none
  while decoding, so ~0, but measured);
- schedule: `Policy.schedule` (and the page-table edits written by `Engine.write_pages`);
- prepare: building the step's inputs (`StepInputBuilder.build`), the attention backend's
  `prepare` (or, replaying a CUDA graph, `DecodeGraphRunner.run` less the replay) and
  `Sampler.prepare`;
- forward: the model call and the LM head (`Engine._run_model` less the above; with CUDA
  graphs, the graph replay);
- sample: `Sampler.sample`, `Sampler.logprobs_device`, recording the sampled tokens for the next
  step, the rest of `Engine.launch` (the copy to the host) and `StepHandle.result` (the
  wait for it and `tolist()`);
- post: the rest of `Scheduler.launch_step` and `Scheduler.finish_step`: advancing
  `cached_len`, appending tokens, building the `DetokenizeMsg` replies, freeing finished
  requests and offering their pages to the prefix cache (all B finish on the last timed
  step; each run starts with the cache empty, as a pool with every page free);
- other: the step's wall time less all of the above (loop bookkeeping, the timers).

Each timed step is one `Scheduler.advance()`, as the process loop runs it: with overlap
(`--overlap`, the default on CUDA) it launches step N+1 and then reads step N.

How: through the scheduler's observer hooks (minisgl/observe.py), the interface it
records request timelines through: the scheduler hands it to its engine, and both mark
where a step's time starts to count toward another phase (`phase(name)`, a no-op in the
server). Here the observer is a lap clock (`phase_timer`): nothing in minisgl/ is patched,
and the phases never overlap and add up to the wall time. On CUDA every mark
synchronises the device, so each phase holds its own device work; the forward is then
device time (plus its launches), and "host" is the step's wall time less the forward.
Those synchronisations also undo any overlap, so each batch size is measured a second
time with the clock off: "free-running wall" is the time per step as the loop really
runs, the figure overlap scheduling improves. On the CPU
everything is host time; "host" is still reported as wall less forward, the part that is
not the model.

    python benchmarks/step_overhead.py --device cpu --hidden-size 128 --vocab-size 4096
    python benchmarks/step_overhead.py --device cuda --json steps.json  # a GPU, 0.6B width

`--hidden-size` and `--vocab-size` shrink the model further (heads of 64, MLP of 3 x
hidden): on a CPU the 0.6B width's LM head (1024 x 151,936) alone is about 0.3 GFLOP per
token, which at batch 256 dominates the step and hides the host overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import (
    cores_used,
    cpu_snapshot,
    model_parser,
    write_json,
)

PHASES = ["receive", "schedule", "prepare", "forward", "sample", "post", "other"]


# ---------------------------------------------------------------------------- timers
def phase_timer(sync: Callable[[], None] | None):
    """A PhaseTimer: an observer of the scheduler (minisgl/observe.py), added to it as
    its timeline is. The scheduler and the engine call `phase(name)` where a step's time starts
    to count toward another phase; the timer adds the time since the previous mark to the
    phase that was current (a lap clock: the phases never overlap and add up to the time
    timed). It also counts the sequences of each step it is told of (`step`)."""
    from minisgl.observe import RequestObserver

    class PhaseTimer(RequestObserver):
        def __init__(self) -> None:
            self.sync = sync or (lambda: None)
            self.timing = False  # off: phase() returns at once (the free-running runs)
            self.sizes: list[int] = []  # sequences in each step launched since reset()
            self.reset()

        def reset(self) -> None:
            self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
            self.sizes = []
            self.current, self.last = "other", time.perf_counter()

        def phase(self, name: str) -> None:
            if not self.timing:
                return
            self.sync()  # on CUDA: each phase holds its own device work
            now = time.perf_counter()
            self.totals[self.current] += now - self.last
            self.current, self.last = name, now

        def step(self, batch, step: int) -> None:
            self.sizes.append(len(batch.reqs))

    return PhaseTimer()


# ---------------------------------------------------------------------------- model
def tiny_config_dir(args: argparse.Namespace, out: Path) -> Path:
    """A copy of the model's config.json with the layer count (and width) overridden."""
    raw = json.loads((Path(args.model) / "config.json").read_text())
    raw["num_hidden_layers"] = args.layers
    if args.hidden_size:
        heads = max(1, args.hidden_size // 64)
        raw.update(
            hidden_size=args.hidden_size,
            intermediate_size=3 * args.hidden_size,
            head_dim=64,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
        )
    if args.vocab_size:
        raw["vocab_size"] = args.vocab_size
        for key in ("bos_token_id", "eos_token_id"):
            if isinstance(raw.get(key), int) and raw[key] >= args.vocab_size:
                raw[key] = args.vocab_size - 1
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


# ---------------------------------------------------------------------------- one run
def measure(scheduler, timer, batch: int, args: argparse.Namespace, seed: int):
    """Per timed step: {phase: seconds} plus "wall" and "batch" (sequences in the step);
    with the timer off (`timer.timing` False) only "wall" is meaningful."""
    from minisgl.core import SamplingParams
    from minisgl.message import UserMsg

    # Every run starts with all pages free: the prefix cache would otherwise still hold the
    # pages of the previous run's sequences (nothing here shares a prefix), and evicting
    # them as this run grows would be counted in its steps.
    scheduler.flush_cache()
    rng = random.Random(seed)
    vocab = scheduler.engine.model_config.vocab_size
    # the first token comes from the prefill; all B finish on the last timed step
    params = SamplingParams(max_tokens=1 + args.warmup + args.steps, ignore_eos=True)
    inbox = [
        UserMsg.make(
            seed * 100_000 + i, [rng.randrange(vocab) for _ in range(args.prompt_len)], params
        )
        for i in range(batch)
    ]
    timing, timer.timing = timer.timing, False
    while inbox or scheduler.policy.prefill_manager.runnable:  # admit and prefill, untimed
        for msg in inbox:
            assert not scheduler.process_msg(msg), "a request was refused"
        inbox = []
        scheduler.step()
    assert len(scheduler.policy.decode_manager.running) == batch, "not all requests decode"
    for _ in range(args.warmup):
        scheduler.advance()
    steps = []
    for _ in range(args.steps):
        timer.reset()
        timer.timing = timing
        start = time.perf_counter()
        timer.phase("receive")
        replies = []
        for msg in inbox:  # what run_forever received for this step: nothing
            replies += scheduler.process_msg(msg)
        timer.phase("other")
        replies += scheduler.advance()
        timer.phase("other")  # the last phase's time (synchronised), then the step's end
        wall = time.perf_counter() - start
        timer.timing = False
        assert timer.sizes == [batch] and len(replies) == batch, (timer.sizes, len(replies))
        rec = dict(timer.totals) if timing else dict.fromkeys(PHASES, 0.0)
        rec["other"] = wall - sum(rec[p] for p in PHASES if p != "other")
        rec["wall"], rec["batch"] = wall, batch
        steps.append(rec)
    while scheduler.has_work:  # the last step's tokens, with overlap
        scheduler.advance()
    assert not scheduler.has_work and scheduler.policy.table_manager.used == 0, "requests left over"
    return steps


def summarize(steps: list[dict]) -> dict:
    """Mean seconds per step of each phase, wall and host (wall less forward)."""
    n = len(steps)
    mean = {k: sum(s[k] for s in steps) / n for k in [*PHASES, "wall"]}
    mean["host"] = mean["wall"] - mean["forward"]
    return mean


def table(batch: int, mean: dict) -> str:
    wall = mean["wall"]
    lines = [f"batch {batch}:", "| phase | us/step | share |", "|---|---:|---:|"]
    for k in [*PHASES, "wall", "host", "free_wall"]:
        name = {
            "wall": "**step (wall)**",
            "host": "host (wall - forward)",
            "free_wall": "free-running wall (no timers)",
        }.get(k, k)
        lines.append(f"| {name} | {mean[k] * 1e6:,.1f} | {100 * mean[k] / wall:.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = model_parser(__doc__, "device", "dtype", "attention_backend", "cuda_graph",
                     default_config="qwen3-0.6b")  # fmt: skip
    p.add_argument("--layers", type=int, default=2, help="num_hidden_layers override")
    p.add_argument("--hidden-size", type=int, default=None, help="narrower model (heads of 64)")
    p.add_argument("--vocab-size", type=int, default=None, help="smaller vocabulary")
    overlap = p.add_mutually_exclusive_group()
    overlap.add_argument(
        "--disable-overlap-schedule",
        dest="overlap",
        action="store_false",
        default=None,
        help="read each step's tokens before the next is scheduled (default: on CUDA only)",
    )
    overlap.add_argument("--overlap", action="store_true", help="overlap even on a CPU")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8"],
        help="weights: float, or int8 weight-only (the quantized kernels; random weights "
        "have no GGUF blocks)",
    )
    args = p.parse_args(argv)

    import torch

    from minisgl.engine.build import build_engine
    from minisgl.engine.config import EngineConfig
    from minisgl.scheduler import Scheduler
    from minisgl.scheduler.config import SchedulerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    max_seq_len = args.prompt_len + args.warmup + args.steps + 8
    # every request's pages fit at once: no preemption (the CPU default sizes the pool
    # from max_running_requests * max_seq_len, which page rounding can leave short)
    num_pages = max(args.batch_sizes) * (-(-max_seq_len // 16) + 1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(
            EngineConfig(
                model=str(tiny_config_dir(args, Path(tmp))),
                device=args.device,
                dtype=args.dtype,
                dummy_weights=True,
                quantization=args.quantization,
                max_running_requests=max(args.batch_sizes),
                max_seq_len=max_seq_len,
                num_pages=num_pages,
                page_size=16,
                attention_backend=args.attention_backend,
                cuda_graph=args.cuda_graph,
            )
        )
    cuda = engine.device.type == "cuda"
    timer = phase_timer(torch.cuda.synchronize if cuda else None)
    scheduler = Scheduler(engine, SchedulerConfig(overlap_schedule=args.overlap))
    scheduler.observe(timer)
    c = engine.model_config
    graphs = engine.graph_runner is not None and bool(engine.graph_runner.graphs)
    print(
        f"{args.model} with {c.num_layers} layers, hidden {c.hidden_size}, vocab "
        f"{c.vocab_size}, random weights, on {engine.device} ({engine.dtype}, "
        f"{type(engine.attn_backend).__name__}, CUDA graphs {'on' if graphs else 'off'}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads); prompt "
        f"{args.prompt_len}, {args.warmup} warm-up + {args.steps} timed decode steps, "
        f"overlap scheduling {'on' if scheduler.overlap else 'off'}"
    )
    results = []
    for i, batch in enumerate(args.batch_sizes):
        before = cpu_snapshot()
        timer.timing = True
        steps = measure(scheduler, timer, batch, args, seed=i + 1)
        timer.timing = False
        free = measure(scheduler, timer, batch, args, seed=i + 1)  # as the loop really runs
        others = cores_used(before, cpu_snapshot())["others"]  # cores (nan: no /proc)
        mean = summarize(steps)
        mean["free_wall"] = sum(s["wall"] for s in free) / len(free)
        print(f"\n{table(batch, mean)}\nothers' CPU meanwhile: {others:.2f} cores")
        results.append({"batch": batch, "others_cores": others, "mean_s": mean, "steps": steps})
    if args.json:
        record = {
            "args": vars(args),
            "model": {"layers": c.num_layers, "hidden": c.hidden_size, "vocab": c.vocab_size},
            "device": str(engine.device),
            "dtype": str(engine.dtype),
            "cuda_graphs": graphs,
            "overlap": scheduler.overlap,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "results": results,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
