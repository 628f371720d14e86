"""Offline throughput: minisgl's engine against transformers' batched `generate`.

The workload is nano-vllm's / mini-sglang's offline benchmark: `random.seed(0)`, then
`--num-seqs` prompts of random token ids in [0, 10000] with lengths uniform in
[--min-len, --max-len], then one `max_tokens` per request uniform in the same range (or
`--output-len` for every request, drawing nothing); EOS ignored, greedy. The figure is
output tokens / wall seconds (CUDA-synchronised on a GPU).

Both engines run the same requests with the same weights in one process: our engine first,
then transformers, built from the same config.json with every tensor copied out of our
engine (so random `--dummy-weights` are shared exactly, and real weights too). Our figure is
printed, and written to `--json`, as soon as our run ends; the file is written again with
the baseline's (`--baseline none`: none at all, our figure alone). Run from the
repository root:

    python benchmarks/offline.py --num-seqs 16 --min-len 32 --max-len 128     # CPU
    python benchmarks/offline.py --num-seqs 16 --min-len 32 --max-len 160 --output-len 64
    python benchmarks/offline.py --config qwen3-0.6b --dummy-weights          # GPU, full size
    python benchmarks/offline.py --num-seqs 16 --min-len 32 --max-len 128 --tp-size 2

With `--tp-size N` our engine is sharded over N ranks (this process and N - 1 children;
gloo on a CPU, so there the figure shows what the collectives cost, NCCL on GPUs), and
transformers gets the whole checkpoint. With random weights each rank draws its own shard,
which transformers cannot load: compare tensor-parallel sizes with each other instead
(`--config llama-60m`, whose heads split over 2 or 4 ranks, `--baseline none --check 0`).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from common import (
    cores_used,
    cpu_snapshot,
    cuda_sync,
    describe,
    engine_options,
    engine_record,
    model_parser,
    write_json,
)

from minisgl import LLM, SamplingParams
from minisgl.models.weight import iter_checkpoint
from minisgl.utils.process import available_ram

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

CPU_BASELINE_BATCH = 16  # see auto_batch_size


@dataclass
class Result:
    engine: str
    requests: int
    input_tokens: int
    output_tokens: int  # tokens the requests asked for and got (the useful output)
    seconds: float
    # every token produced, also those a static batch made past a request's max_tokens
    generated_tokens: int
    others_cpu: float | None = None  # share of the machine's CPU other processes used meanwhile

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---------------------------------------------------------------------------- workload
def make_workload(
    num_seqs: int, min_len: int, max_len: int, output_len: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py order: every prompt first, then every max_tokens. A fixed
    `output_len` draws no max_tokens, so the prompts are the same as without it."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
        for _ in range(num_seqs)
    ]
    if output_len is not None:
        return prompts, [output_len] * num_seqs
    max_tokens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def greedy_params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in max_tokens]


class TimedRun:
    """`with TimedRun(device) as t:` times one engine's run: the device synchronised at both
    ends, the wall seconds, and the share of the machine's CPUs that other processes took
    meanwhile (Linux; None elsewhere): on a shared machine a busy neighbour slows both
    engines, and a figure measured beside one is not comparable."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> TimedRun:
        cuda_sync(self.device)
        self._cpu = cpu_snapshot()
        return self

    def __exit__(self, *exc) -> None:
        cuda_sync(self.device)
        end = cpu_snapshot()
        self.seconds = end["t"] - self._cpu["t"]
        others = cores_used(self._cpu, end)["others"]
        self.others_cpu = None if math.isnan(others) else max(0.0, others) / (os.cpu_count() or 1)

    def result(self, engine: str, prompts, output_tokens: int, generated_tokens: int) -> Result:
        return Result(
            engine, len(prompts), sum(map(len, prompts)), output_tokens, self.seconds,
            generated_tokens=generated_tokens, others_cpu=self.others_cpu,
        )  # fmt: skip


# ---------------------------------------------------------------------------- our engine
def run_minisgl(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    with TimedRun(llm.engine.device) as timed:
        outputs = llm.generate(prompts, greedy_params(max_tokens))
    produced = sum(len(o.token_ids) for o in outputs)
    result = timed.result("minisgl", prompts, produced, generated_tokens=produced)
    return result, [o.token_ids for o in outputs], outputs


def sanity_failures(outputs, max_tokens: list[int]) -> list[str]:
    """Every request must end by length with exactly its max_tokens tokens."""
    bad = []
    for i, (out, n) in enumerate(zip(outputs, max_tokens)):
        if out.error is not None:
            bad.append(f"request {i}: error {out.error!r}")
        elif len(out.token_ids) != n or out.finish_reason != "length":
            bad.append(f"request {i}: {len(out.token_ids)} tokens ({out.finish_reason}), asked {n}")
    return bad


def hf_state_dict(llm: LLM) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names: fused q/k/v and gate/up split back apart.
    The tensors are views of the engine's weights (no copy)."""
    cfg = llm.engine.model_config
    fused = {
        ".qkv_proj.": (
            [".q_proj.", ".k_proj.", ".v_proj."],
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
        ),
        ".gate_up_proj.": ([".gate_proj.", ".up_proj."], [cfg.intermediate_size] * 2),
    }
    out: dict[str, torch.Tensor] = {}
    for name, param in llm.engine.model.named_parameters():  # a tied lm_head appears once
        for ours, (theirs, sizes) in fused.items():
            if ours in name:
                for part, tensor in zip(theirs, param.detach().split(sizes, dim=0)):
                    out[name.replace(ours, part)] = tensor
                break
        else:
            out[name] = param.detach()
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---------------------------------------------------------------------------- transformers
def build_hf_model(model_dir: Path, weights: dict[str, torch.Tensor], dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.load_state_dict(weights, strict=True)  # every tensor is ours: none stays random
    # No EOS at all (not min_new_tokens, which would mask the EOS logit and so change greedy
    # picks): every row runs exactly max_new_tokens, like ignore_eos in our engine.
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None
    )
    return model.eval()


def auto_batch_size(cfg: ModelConfig, prompts, max_tokens, dtype, device) -> int:
    """All requests in one batch where memory allows. On a GPU that is transformers' best
    case (one decode loop, host overhead paid once per step); the cap keeps the padded KV
    cache and the prefill activations under 70% of free memory. On a CPU: 16, a middle
    ground between matmul efficiency and padding waste (every row of a static batch runs
    as many steps as the batch's longest request); --baseline-batch-size tries others."""
    n = len(prompts)
    prompt_len, new = max(map(len, prompts)), max(max_tokens)
    elem = dtype.itemsize
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * (prompt_len + new)
    prefill = prompt_len * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * elem
    scores = cfg.num_heads * prompt_len * prompt_len * elem  # if sdpa falls back to math
    logits = cfg.vocab_size * 4 * 2
    per_request = kv + prefill + scores + logits
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, min(n, int(0.7 * free) // per_request))
    return max(1, min(n, CPU_BASELINE_BATCH, int(0.5 * available_ram()) // per_request))


def run_transformers(model, prompts, max_tokens, batch_size: int, device):
    """Static batching as transformers does it. Requests are sorted by max_tokens and cut into
    batches of `batch_size`, which keeps each batch's spread of max_tokens small (the order
    our engine never needs). A batch runs max(max_tokens) steps for all its rows (generate
    has one length per batch); each row is then cut to its own max_tokens, and only those
    tokens count as output: the rest is the waste of static batching, reported separately
    as generated_tokens. Prompts are left-padded with an attention mask."""
    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i])
    outputs: list[list[int]] = [[] for _ in prompts]
    generated = 0
    with TimedRun(device) as timed:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            new = max(max_tokens[i] for i in idx)
            with torch.inference_mode():
                seqs = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new,
                    do_sample=False,
                )
            seqs = seqs[:, width:].tolist()  # the .tolist() syncs: the batch is done
            for row, i in enumerate(idx):
                outputs[i] = seqs[row][: max_tokens[i]]
                generated += len(seqs[row])
    useful = sum(map(len, outputs))
    return timed.result("transformers", prompts, useful, generated_tokens=generated), outputs


def run_transformers_cb(model, prompts, max_tokens, device):
    """transformers' own continuous batching (its paged cache and scheduler): every request
    is queued at once with its own max_new_tokens, end-of-sequence disabled, greedy."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=None, pad_token_id=0
    )
    outputs: list[list[int]] = [[] for _ in prompts]
    with TimedRun(device) as timed:
        manager = model.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
            for _ in prompts:
                out = manager.get_result(timeout=3600)
                if out is None:
                    raise RuntimeError("transformers' continuous batching returned no result")
                outputs[int(out.request_id)] = list(out.generated_tokens)
        finally:
            manager.stop(block=True)
    useful = sum(map(len, outputs))
    return timed.result("transformers-cb", prompts, useful, generated_tokens=useful), outputs


def best_of(repeat: int, run):
    """The fastest of `repeat` runs (as timeit does): noise from a shared machine only ever
    adds time. Every run does the whole workload; the outputs are the same greedy tokens."""
    best = None
    for _ in range(repeat):
        out = run()
        if best is None or out[0].seconds < best[0].seconds:
            best = out
    return best


# ---------------------------------------------------------------------------- report
def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many requests match exactly, and where the others first differ."""
    diverged = {}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diverged[i] = first
    return {"requests": len(ours), "exact": len(ours) - len(diverged), "first_diff": diverged}


def print_table(results: list[Result]) -> None:
    head = f"{'engine':<13}{'requests':>9}{'input tok':>11}{'output tok':>12}{'seconds':>10}{'output tok/s':>14}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.engine:<13}{r.requests:>9}{r.input_tokens:>11}{r.output_tokens:>12}"
            f"{r.seconds:>10.2f}{r.tok_per_s:>14.1f}"
        )
    for r in results:
        if r.others_cpu is not None and r.others_cpu > 0.05:
            print(
                f"note: other processes used {r.others_cpu:.0%} of the CPUs during the {r.engine} "
                "run; its figure is slowed by them"
            )


# the engine's own flags, as `python -m minisgl` takes them (--max-seq-len is this
# script's: its default depends on the requests)
ENGINE_FLAGS = (
    "device", "dtype", "page_size", "tp_size", "max_running_requests", "max_prefill_tokens",
    "num_pages", "attention_backend", "quantization",
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = model_parser(__doc__, *ENGINE_FLAGS)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max_tokens of every request (default: uniform in [--min-len, --max-len])",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="engine context (default: the longest request, --max-len + the longest output)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time each engine this many times and keep its fastest run (noisy machines)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--baseline",
        default="transformers",
        choices=["transformers", "transformers-cb", "none"],
        help="transformers: its batched generate (static batches); transformers-cb: its "
        "continuous batching (generate_batch's manager); none: no baseline",
    )
    p.add_argument(
        "--baseline-batch-size",
        type=int,
        default=None,
        help="transformers batch (default: all requests where memory allows; 16 on CPU)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a short untimed run of a few requests first (default on)",
    )
    p.add_argument(
        "--check",
        type=int,
        nargs="?",
        const=4,
        default=0,
        metavar="N",
        help="compare greedy tokens with transformers' for the first N (4) requests; float32 only",
    )
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.output_len is not None and args.output_len < 1:
        p.error("need --output-len >= 1")
    if args.tp_size > 1 and args.dummy_weights and (args.baseline != "none" or args.check):
        # each rank draws its own shard: together they are no model transformers could load
        p.error("--tp-size > 1 with random weights needs --baseline none --check 0")
    return args


def build_llm(args: argparse.Namespace) -> LLM:
    llm = LLM(
        model=args.model,
        dummy_weights=args.dummy_weights,
        max_seq_len=args.max_seq_len or args.max_len + max(args.max_len, args.output_len or 0),
        **engine_options(args, *ENGINE_FLAGS),
    )
    print(
        f"{describe(llm.engine)}, {'random' if args.dummy_weights else 'real'} weights; "
        f"{args.num_seqs} requests, lengths {args.min_len}..{args.max_len}"
        + (f", {args.output_len} output tokens each" if args.output_len else "")
    )
    return llm


def run_baseline(args, hf, cfg, prompts, max_tokens, warm, device):
    """transformers on the whole workload, or (`--baseline none`) on the checked requests only,
    one at a time. Returns (result or None, its tokens, batch size or None)."""
    if args.baseline == "none":
        k = args.check
        _, tokens = run_transformers(hf, prompts[:k], max_tokens[:k], 1, device)
        return None, tokens, None
    if args.baseline == "transformers-cb":
        print("transformers: continuous batching, every request queued at once")
        if args.warmup:
            run_transformers_cb(hf, *warm, device)
        run = partial(run_transformers_cb, hf, prompts, max_tokens, device)
        result, tokens = best_of(args.repeat, run)
        return result, tokens, None
    batch = args.baseline_batch_size or auto_batch_size(cfg, prompts, max_tokens, hf.dtype, device)
    print(f"transformers: batches of {batch}, grouped by max_tokens")
    if args.warmup:
        run_transformers(hf, *warm, len(warm[0]), device)
    run = partial(run_transformers, hf, prompts, max_tokens, batch, device)
    result, tokens = best_of(args.repeat, run)
    return result, tokens, batch


def report(results: list[Result], check: dict | None, failures: list[str], n: int) -> None:
    print()
    print_table(results)
    if len(results) == 2:
        ours, theirs = results
        waste = theirs.generated_tokens - theirs.output_tokens
        print(
            f"\nminisgl / transformers: {ours.tok_per_s / theirs.tok_per_s:.2f}x   (transformers "
            f"generated {theirs.generated_tokens} tokens; {waste} past a request's max_tokens "
            "are not counted)"
        )
    if check is not None:
        diffs = ", ".join(f"#{i} at token {t}" for i, t in check["first_diff"].items())
        print(
            f"check: {check['exact']}/{check['requests']} requests match transformers' greedy "
            f"tokens exactly" + (f"; diverged: {diffs}" if diffs else "")
        )
    if failures:
        print(f"SANITY FAILED: {len(failures)} request(s) did not get exactly max_tokens tokens:")
        print("\n".join("  " + f for f in failures[:10]))
    else:
        print(f"sanity: all {n} requests produced exactly max_tokens tokens")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, max_tokens = make_workload(args.num_seqs, args.min_len, args.max_len, args.output_len)
    # warm-up requests come from their own generator: the workload stays nano-vllm's
    rng = random.Random(1)
    warm = (
        [[rng.randint(0, 10000) for _ in range(args.min_len)] for _ in range(4)],
        [min(8, args.max_len)] * 4,
    )

    llm = build_llm(args)
    engine = llm.engine
    device, dtype, model_dir, cfg = (
        engine.device,
        engine.dtype,
        engine.model_dir,
        engine.model_config,
    )
    what_ran = engine_record(engine)
    if args.warmup:
        llm.generate(warm[0], greedy_params(warm[1]))
    ours, our_tokens, outputs = best_of(args.repeat, partial(run_minisgl, llm, prompts, max_tokens))
    failures = sanity_failures(outputs, max_tokens)
    # our figure the moment it exists: a run cut short during the baseline still has it
    print(f"minisgl: {ours.output_tokens} output tokens in {ours.seconds:.2f} s, "
          f"{ours.tok_per_s:,.0f} tok/s", flush=True)  # fmt: skip
    if args.json:
        write_json(args.json, record(args, what_ran, [ours], None, None, failures))

    # Free our KV pool before transformers allocates its cache; keep only the weights.
    quantized = engine.quantization != "none"
    if engine.tp.size == 1 and not quantized:
        weights = hf_state_dict(llm)
    else:  # a rank holds a shard, or quantized weights: transformers gets the float
        # checkpoint (real weights: random ones are refused unless transformers is left out)
        weights = {}
        if not args.dummy_weights:
            weights = {name: t.to(dtype) for name, t in iter_checkpoint(model_dir)}
            if cfg.tie_word_embeddings:
                weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
        llm.close()
    del llm, engine, outputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    results, check, batch = [ours], None, None
    want_check = args.check > 0 and dtype == torch.float32 and not quantized
    if args.check > 0 and not want_check:
        print(
            "--check skipped: greedy tokens are compared with float32 weights only (this run: "
            f"{dtype}, weights {'quantized' if quantized else 'float'}; --quantization none)"
        )
    if args.baseline != "none" or want_check:
        hf = build_hf_model(model_dir, weights, dtype, device)
        del weights
        theirs, their_tokens, batch = run_baseline(args, hf, cfg, prompts, max_tokens, warm, device)
        if theirs is not None:
            results.append(theirs)
        if want_check:
            k = min(args.check, len(prompts))
            check = compare(our_tokens[:k], their_tokens[:k])
    report(results, check, failures, len(prompts))

    if args.json:
        write_json(args.json, record(args, what_ran, results, batch, check, failures))
    return 1 if failures else 0


def record(args, what_ran: dict, results: list[Result], batch, check, failures) -> dict:
    """The --json file: written with our result alone first, then again when the baseline
    (if any) has run."""
    return {
        "args": vars(args),
        **what_ran,
        "baseline_batch_size": batch,
        "results": [asdict(r) | {"tok_per_s": r.tok_per_s} for r in results],
        "ratio": results[0].tok_per_s / results[1].tok_per_s if len(results) == 2 else None,
        "check": check,
        "sanity_failures": failures,
    }


if __name__ == "__main__":
    sys.exit(main())
