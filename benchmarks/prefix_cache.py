"""Prefix cache: requests sharing a long system prompt, with the radix cache off and on.

The workload (seeded, random token ids in [0, 10000]): one system prompt of
`--system-len` tokens (1,024), then `--num-seqs` requests (16), each the system prompt plus
`--unique-len` tokens of its own (32), `--output-len` greedy tokens each (16), EOS ignored.
All requests go to `LLM.stream` at once; a request's time to first token runs from that
moment to its first token, the total until the last token of all. Each mode has its own
engine (same weights), warmed up on an unrelated prompt; the rounds alternate off and on,
and the cache is emptied before every round, so each round pays for its first prefill of
the shared prompt (the best round of each mode is reported, as timeit does: noise only
ever adds time). Both modes must produce the same tokens.

    python benchmarks/prefix_cache.py                          # CPU, the embedded model
    python benchmarks/prefix_cache.py --config qwen3-0.6b      # GPU, random weights
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from common import (
    cuda_sync,
    describe,
    engine_record,
    model_parser,
    write_json,
)

from minisgl import LLM, SamplingParams


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randint(0, 10000) for _ in range(args.system_len)]
    return [
        system + [rng.randint(0, 10000) for _ in range(args.unique_len)]
        for _ in range(args.num_seqs)
    ]


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """One round: {ttft: [seconds per request], total: seconds, tokens: [[ids]]}."""
    llm.scheduler.flush_cache()  # every round starts with nothing cached
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    ttft: list[float | None] = [None] * len(prompts)
    cuda_sync(llm.engine.device)
    start = time.perf_counter()
    outputs = [None] * len(prompts)
    for event in llm.stream(prompts, params):
        if ttft[event.index] is None:
            ttft[event.index] = time.perf_counter() - start
        outputs[event.index] = event.output
    cuda_sync(llm.engine.device)
    total = time.perf_counter() - start
    return {"ttft": ttft, "total": total, "tokens": [o.token_ids for o in outputs]}


def main(argv: list[str] | None = None) -> int:
    p = model_parser(__doc__, "device", "dtype")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--unique-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2, help="rounds per mode; the best is kept")
    args = p.parse_args(argv)
    prompts = workload(args)
    warm = [[7] * 64]
    max_seq_len = args.system_len + args.unique_len + args.output_len + 16
    # both engines in one process: each gets a pool sized for the workload (pages of 16),
    # not a share of the free memory, which the first one would take almost all of
    num_pages = 2 * args.num_seqs * (-(-max_seq_len // 16) + 1)
    llms = {
        mode: LLM(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            dummy_weights=args.dummy_weights,
            prefix_cache=mode,
            max_seq_len=max_seq_len,
            max_running_requests=max(args.num_seqs, 16),
            page_size=16,
            num_pages=num_pages,
        )
        for mode in ("none", "radix")
    }
    if args.dummy_weights:  # the same random weights in both engines
        llms["radix"].engine.model.load_state_dict(llms["none"].engine.model.state_dict())
    e = llms["none"].engine
    print(
        f"{describe(e)}; {args.num_seqs} requests "
        f"of a {args.system_len}-token shared prompt + {args.unique_len} own tokens, "
        f"{args.output_len} output tokens each, all at once"
    )
    for llm in llms.values():
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    rounds: dict[str, list[dict]] = {"none": [], "radix": []}
    for _ in range(args.repeat):
        for mode, llm in llms.items():
            rounds[mode].append(run(llm, prompts, args.output_len))
    best = {m: min(rs, key=lambda r: r["total"]) for m, rs in rounds.items()}
    same = best["none"]["tokens"] == best["radix"]["tokens"]

    print(f"\n{'cache':<7}{'mean TTFT s':>13}{'max TTFT s':>12}{'total s':>10}")
    for mode, r in best.items():
        print(
            f"{mode:<7}{statistics.mean(r['ttft']):>13.3f}{max(r['ttft']):>12.3f}"
            f"{r['total']:>10.3f}"
        )
    mean = {m: statistics.mean(r["ttft"]) for m, r in best.items()}
    ttft_x = mean["none"] / mean["radix"]
    total_x = best["none"]["total"] / best["radix"]["total"]
    hits = llms["radix"].scheduler.policy.cache_manager.hit_tokens // args.repeat
    print(
        f"\nwith the cache: mean time to first token {ttft_x:.1f}x better, total {total_x:.1f}x;"
        f" {hits} prompt tokens reused per round; tokens identical: {same}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                **engine_record(e),
                "mean_ttft_s": mean,
                "total_s": {m: r["total"] for m, r in best.items()},
                "ttft_ratio": ttft_x,
                "total_ratio": total_x,
                "reused_tokens_per_round": hits,
                "identical": same,
            },
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
