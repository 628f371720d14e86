"""The embedded GGUF served from its own blocks (`--quantization gguf`) against the float32
path (`--quantization none`): memory at rest, perplexity, greedy answers, decode speed.

Each quantization is measured in a fresh process (memory figures of one process do not
mix with another's):

- memory (a process of its own): /proc/self/status once torch, transformers and the
  tokenizer are loaded and before the engine is built, then after it (`VmRSS`, and
  `RssAnon`, which leaves out the shared libraries' pages); the bytes of
  every weight tensor the model holds; the KV pool's size (allocated with torch.empty, so
  its pages count in RSS only once written); the GGUF file's size. The target: RSS
  added by the load <= 1.2 x the GGUF file + the KV pool.
- perplexity of a fixed English text (below, 700-odd tokens), by teacher forcing through
  the engine's own model code with a plain causal attention over the whole text, in chunks
  of `--chunk` tokens (64: the decode kernels; 512: prefill's dequantized GEMM).
- the greedy answers (32 tokens) to the chapter's example prompts.
- batch-1 decode: ms per token after a 128-token prompt (fastest of 3), threads as given.

    python benchmarks/quantization.py            # gguf and none, then the comparison
    python benchmarks/quantization.py --threads 2 --json quantization.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from common import script_parser, write_json

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined several existing technologies into a system that could produce "
    "books faster and more cheaply than ever before. Before the press, books were copied by "
    "hand, usually by monks or professional scribes, and a single volume could take months "
    "to finish. Movable type made of metal allowed a printer to arrange letters into lines "
    "and pages, print many copies, and then reuse the same letters for the next page. The "
    "results were dramatic. Within a few decades, printing shops had opened in more than two "
    "hundred cities across Europe, and millions of books were in circulation. Prices fell, "
    "literacy spread, and ideas could travel much farther than the people who first wrote "
    "them down. Scientists could compare their observations with those of colleagues in "
    "other countries, and scholars could study identical copies of the same text. Many "
    "historians argue that the printing press helped make the scientific revolution and the "
    "reformation possible, because it allowed arguments to reach large audiences quickly. "
    "The technology itself changed slowly over the following centuries. Wooden presses were "
    "replaced by iron ones, steam power arrived in the nineteenth century, and rotary "
    "presses could print thousands of newspaper pages every hour. Each improvement lowered "
    "the cost of information again. Today most text is read on screens, yet the basic idea "
    "remains the same: a single original can be copied many times at almost no cost, and "
    "that simple fact continues to shape how people learn, work and communicate. In the "
    "kitchen, a good soup starts with a simple stock. Onions, carrots and celery are cooked "
    "slowly in a little oil until they are soft, then water and a few herbs are added and the "
    "pot is left to simmer for an hour. The stock is strained, seasoned with salt and pepper, "
    "and used as the base for many other dishes. A small computer program that adds two "
    "numbers reads them from the user, converts them from text to integers, adds them and "
    "prints the result. If the user types something that is not a number, the program should "
    "explain the problem politely and ask again instead of crashing."
)
PROMPTS = [  # the chapter's examples
    [{"role": "user", "content": "什么是 KV Cache？"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    "The capital of France is",
]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class CausalContext:
    """Attention for one sequence fed in chunks: each layer's K/V so far, kept here."""

    def __init__(self) -> None:
        self.k: dict[int, object] = {}
        self.v: dict[int, object] = {}

    def attention(self, layer_id, q, k, v):
        import torch
        import torch.nn.functional as F

        if layer_id in self.k:
            k = torch.cat([self.k[layer_id], k])
            v = torch.cat([self.v[layer_id], v])
        self.k[layer_id], self.v[layer_id] = k, v
        T, S = q.shape[0], k.shape[0]
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # chunk rows see the past
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(0, 1)


def perplexity(engine, ids: list[int], chunk: int) -> float:
    import torch

    model, ctx, nll = engine.model, CausalContext(), 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = torch.tensor(ids[start : start + chunk])
            positions = torch.arange(start, start + len(piece))
            logits = model.logits(model(piece, positions, ctx))  # (T, vocab) float32
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            logits = logits[: len(targets)]
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
    return math.exp(nll / (len(ids) - 1))


def memory(args) -> dict:
    """RSS added by building the engine (weights, KV pool, step buffers), everything else
    (torch, transformers, the tokenizer, torch's meta-tensor code) loaded before."""
    import torch

    from minisgl.engine.build import build_engine
    from minisgl.engine.config import EngineConfig
    from minisgl.models.default_model import default_model_dir, find_default_gguf
    from minisgl.tokenizer.tokenize import load_tokenizer

    torch.set_num_threads(args.threads)
    load_tokenizer(default_model_dir())
    with torch.device("meta"):
        torch.arange(2)
    before = _status()
    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(device="cpu", quantization=args.quantization,
                                 max_running_requests=4, max_seq_len=1024))  # fmt: skip
    load_s = time.perf_counter() - t0
    after = _status()
    model = engine.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    rope = model.model.rotary
    table_bytes = sum(t.numel() * t.element_size() for t in (rope.cos, rope.sin))
    return {
        "quantization": engine.quantization,
        "load_s": load_s,
        "rss_before": before,
        "rss_after": after,
        "weight_bytes": sum(t.numel() * t.element_size() for t in tensors.values()) - table_bytes,
        "rope_table_bytes": table_bytes,
        "kv_pool_bytes": 2 * engine.pool.k.numel() * engine.pool.k.element_size(),
        "gguf_bytes": find_default_gguf().stat().st_size,
    }


def quality(args) -> dict:
    import torch

    from minisgl import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(device="cpu", quantization=args.quantization, max_running_requests=4,
              max_seq_len=1024)  # fmt: skip
    record = {"threads": args.threads}
    ids = llm.tokenizer(TEXT).input_ids
    record["text_tokens"] = len(ids)
    record["perplexity"] = {c: perplexity(llm.engine, ids, c) for c in args.chunk}
    greedy = SamplingParams(max_tokens=32, temperature=0)
    record["answers"] = [o.text for o in llm.generate(PROMPTS, greedy)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    runs = []
    for _ in range(4):
        llm.scheduler.flush_cache()
        stamps = [time.perf_counter() for _ in llm.stream([ids[:128]], params)]
        runs.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3)
    record["decode_ms_per_token"] = min(runs[1:])
    return record


def child(args) -> dict:
    return memory(args) if args.child == "memory" else quality(args)


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--quantization", nargs="+", default=["gguf", "none"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, nargs="+", default=[64, 512])
    p.add_argument("--child", choices=["memory", "quality"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.quantization = args.quantization[0]
        print(json.dumps(child(args)))
        return 0
    records = []
    for q in args.quantization:
        record = {}
        for part in ("memory", "quality"):  # each in a fresh process
            cmd = [sys.executable, __file__, "--child", part, "--quantization", q, "--threads",
                   str(args.threads), "--chunk", *map(str, args.chunk)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            record.update(json.loads(out.strip().splitlines()[-1]))
        records.append(record)
    mb = 2**20
    for r in records:
        added = r["rss_after"]["VmRSS"] - r["rss_before"]["VmRSS"]
        anon = r["rss_after"]["RssAnon"] - r["rss_before"]["RssAnon"]
        bound = 1.2 * r["gguf_bytes"] + r["kv_pool_bytes"]
        print(
            f"--quantization {r['quantization']}: load {r['load_s']:.1f} s; weights "
            f"{r['weight_bytes'] / mb:.1f} MB ({r['weight_bytes'] / r['gguf_bytes']:.2f}x the "
            f"{r['gguf_bytes'] / mb:.1f} MB GGUF); RSS {r['rss_before']['VmRSS'] / mb:.0f} -> "
            f"{r['rss_after']['VmRSS'] / mb:.0f} MB (+{added / mb:.0f}, anonymous +"
            f"{anon / mb:.0f}); KV pool {r['kv_pool_bytes'] / mb:.0f} MB; bound 1.2 x GGUF + "
            f"KV = {bound / mb:.0f} MB: {'met' if added <= bound else 'NOT met'}"
        )
        ppl = ", ".join(f"chunks of {c}: {v:.3f}" for c, v in r["perplexity"].items())
        print(f"  perplexity ({r['text_tokens']} tokens) {ppl}")
        print(f"  batch-1 decode {r['decode_ms_per_token']:.1f} ms/token ({r['threads']} thr)")
    if len(records) == 2:
        a, b = records
        for c in a["perplexity"]:
            ratio = a["perplexity"][c] / b["perplexity"][c]
            print(f"perplexity {a['quantization']} / {b['quantization']}, chunks of {c}: "
                  f"{ratio:.4f}")  # fmt: skip
        print(f"decode ms/token {a['quantization']} / {b['quantization']}: "
              f"{a['decode_ms_per_token'] / b['decode_ms_per_token']:.2f}")  # fmt: skip
        for prompt, x, y in zip(PROMPTS, a["answers"], b["answers"]):
            print(
                f"\nprompt: {prompt!r}\n  {a['quantization']}: {x!r}\n  {b['quantization']}: {y!r}"
            )
    if args.json:
        write_json(args.json, {"records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
