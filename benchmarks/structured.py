"""Structured output: throughput with a JSON-schema constraint against without, on the same
requests and the same number of output tokens.

The workload (seeded): `--num-seqs` chat requests asking for JSON, each constrained by one
of a few schemas (every string bounded), greedy, `max_tokens` 200. The constrained run goes
first; each request's output length from it becomes that request's `max_tokens` (EOS
ignored) for the unconstrained run, so both produce exactly the same number of tokens and
the figure is output tokens per second, constrained / unconstrained. Best of `--repeat`
rounds each, alternating, in one process with one engine.

    python benchmarks/structured.py                              # CPU, the embedded model
    python benchmarks/structured.py --device cuda                # a GPU, the same model

A grammar is built over a tokenizer's vocabulary and the prompts are chat messages, so the
model needs a tokenizer: a `--config` folder (a config alone) is refused.
"""

from __future__ import annotations

import json
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

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "celsius", "sunny"],
        "additionalProperties": False,
    },
]


def timed(llm: LLM, prompts, params) -> tuple[float, list]:
    cuda_sync(llm.engine.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    cuda_sync(llm.engine.device)
    return time.perf_counter() - start, outs


def main(argv: list[str] | None = None) -> int:
    p = model_parser(__doc__, "device")
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    llm = LLM(model=args.model, device=args.device, dummy_weights=args.dummy_weights)
    if llm.tokenizer is None:
        print(f"{args.model} has no tokenizer: structured output needs one (use --model)")
        return 2
    prompts = [
        [{"role": "user", "content": f"Request {i}: answer with a JSON record, please."}]
        for i in range(args.num_seqs)
    ]
    constrained = [
        SamplingParams(max_tokens=200, json_schema=json.dumps(SCHEMAS[i % len(SCHEMAS)]))
        for i in range(args.num_seqs)
    ]
    llm.generate(prompts[:2], constrained[:2])  # warm-up: compiled grammars, token table
    _, outs = timed(llm, prompts, constrained)
    lengths = [len(o.token_ids) for o in outs]
    free = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    valid = all(o.outputs[0].finish_reason == "stop" and json.loads(o.text) for o in outs)
    best = {"constrained": float("inf"), "free": float("inf")}
    for _ in range(args.repeat):
        best["constrained"] = min(best["constrained"], timed(llm, prompts, constrained)[0])
        best["free"] = min(best["free"], timed(llm, prompts, free)[0])
    tokens = sum(lengths)
    rate = {k: tokens / s for k, s in best.items()}
    ratio = rate["constrained"] / rate["free"]
    print(
        f"{describe(llm.engine)}: {args.num_seqs} requests, {tokens} output tokens "
        f"each way; every constrained output valid JSON ending in stop: {valid}\n"
        f"constrained {best['constrained']:.2f} s ({rate['constrained']:.1f} tok/s), "
        f"unconstrained {best['free']:.2f} s ({rate['free']:.1f} tok/s): {ratio:.2f}x"
    )
    if args.json:
        write_json(args.json, {"args": vars(args), **engine_record(llm.engine), "tokens": tokens, "seconds": best,
                               "tok_per_s": rate, "ratio": ratio, "valid": valid})  # fmt: skip
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
