"""Batch-1 decode latency: one request with a 512-token prompt, time per output token.

The first token (prefill) is excluded: the figure is (time of the last token - time of the
first) / (tokens - 1), read from the offline API's stream as tokens are produced. On CUDA
each token's time includes the host round trip, as a user sees it. Every run starts with
the prefix cache empty, so the first token is always a full prefill of the prompt.

    python benchmarks/decode_latency.py --config qwen3-0.6b --dummy-weights      # a GPU
    python benchmarks/decode_latency.py --prompt-len 128 --output-len 32         # the CPU model
"""

from __future__ import annotations

import random
import sys
import time

from common import (
    describe,
    engine_options,
    engine_record,
    model_parser,
    write_json,
)

from minisgl import LLM, SamplingParams


def measure(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per later token) for one request."""
    llm.scheduler.flush_cache()  # the same prompt every run: its first token is a prefill
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    stamps: list[tuple[float, int]] = []  # (when, tokens so far) at each event
    start = time.perf_counter()
    for event in llm.stream([prompt], params):
        stamps.append((time.perf_counter(), len(event.output.token_ids)))
    (first, n_first), (last, n_last) = stamps[0], stamps[-1]
    return first - start, (last - first) / max(1, n_last - n_first)


ENGINE_FLAGS = ("device", "attention_backend", "cuda_graph", "native_decode")  # minisgl's own flags


def main(argv: list[str] | None = None) -> int:
    p = model_parser(__doc__, *ENGINE_FLAGS)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3, help="keep the fastest run")
    args = p.parse_args(argv)

    llm = LLM(
        args.model,
        dummy_weights=args.dummy_weights,
        **engine_options(args, *ENGINE_FLAGS),
        max_running_requests=8,
        max_seq_len=args.prompt_len + args.output_len + 16,
    )
    rng = random.Random(0)
    prompt = [rng.randint(0, 10000) for _ in range(args.prompt_len)]
    measure(llm, prompt, 8)  # warm-up: kernels compiled, caches primed
    runs = [measure(llm, prompt, args.output_len) for _ in range(args.repeat)]
    ttft, per_token = min(runs, key=lambda r: r[1])
    print(
        f"{describe(llm.engine)}: prompt {args.prompt_len}, {args.output_len} tokens: first "
        f"token {ttft * 1e3:.1f} ms, then {per_token * 1e3:.3f} ms per token"
    )
    if args.json:
        record = {
            **engine_record(llm.engine),
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "ttft_ms": ttft * 1e3,
            "ms_per_token": per_token * 1e3,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
