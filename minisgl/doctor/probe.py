"""The doctor's throughput probe: prefill and decode tokens per second at a real model shape.

Contract: `run(device, seconds, not_checked)` builds an engine over random weights of a real
shape (Qwen3-0.6B's in bfloat16 on a GPU, with the engine's defaults: Triton attention,
CUDA graphs, overlapped decode steps; SmolLM2-135M's, the embedded default model, in
float32 on a CPU), spends half of `seconds` on prefill steps and half on decode steps
(engine/sequences.py: the engine alone, no scheduler), and returns the figures, or None
(with the reason added to `not_checked`) when it cannot run. `cuda_graph=False` runs the
decode steps eagerly (--disable-cuda-graph), for what the graphs save. The start-up
self-check is skipped here: the checks before it ran it already.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch

from .checks import write_config

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000,
)  # fmt: skip
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000,
)  # fmt: skip
# (model, name, prefill batch x prompt tokens, decode batch x prompt tokens, most new tokens)
WORKLOAD = {
    "cuda": (QWEN3_0_6B, "Qwen3-0.6B", (8, 1024), (64, 128), 512),
    "cpu": (SMOLLM2_135M, "SmolLM2-135M", (2, 64), (4, 16), 32),
}


def run(
    device: torch.device, seconds: float, not_checked: list[dict], cuda_graph: bool = True
) -> dict | None:
    if seconds <= 0:
        not_checked.append({"name": "throughput", "reason": "--probe-seconds 0"})
        return None
    try:
        from minisgl.engine.build import build_engine
        from minisgl.engine.config import EngineConfig
        from minisgl.engine.sequences import Sequences
        from minisgl.kvcache import pages_for
    except ImportError as exc:
        not_checked.append({"name": "throughput", "reason": f"the engine cannot be imported "
                            f"here ({exc}): pip install msgspec"})  # fmt: skip
        return None
    shape, name, (pb, plen), (db, dlen), most_new = WORKLOAD[device.type]
    cuda = device.type == "cuda"
    ps = 16
    pages = max(pb * pages_for(plen + 1, ps), db * pages_for(dlen + most_new, ps)) + 8
    try:
        with tempfile.TemporaryDirectory(prefix="minisgl-probe-") as tmp:
            model_dir = write_config(Path(tmp), {"tie_word_embeddings": True, **shape})
            engine = build_engine(
                EngineConfig(
                    model=str(model_dir), device=device.type, dummy_weights=True,
                    page_size=ps, num_pages=pages, max_running_requests=max(pb, db),
                    max_seq_len=max(plen + 1, dlen + most_new), self_check="skip",
                    cuda_graph=cuda_graph,
                )
            )  # fmt: skip
            rng = random.Random(0)
            vocab = shape["vocab_size"]

            def prompts(n: int, length: int) -> list[list[int]]:
                return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

            overlap = cuda  # as the server runs on a GPU
            Sequences(engine, prompts(2, 8), 4).generate(overlap)  # warm-up (and compile)
            prefill = Sequences(engine, prompts(pb, plen), 1)
            runs, spent = 0, 0.0
            while runs == 0 or spent < seconds / 2:
                started = time.perf_counter()
                prefill.generate(overlap)
                spent += prefill.finished_at - started
                runs += 1
            prefill_tps = runs * pb * plen / spent

            new = 8  # a first short run tells the step time; then runs of the time left
            decode = Sequences(engine, prompts(db, dlen), most_new)
            tokens, spent = 0, 0.0
            while tokens == 0 or spent < seconds / 2:
                decode.max_new = new
                decode.generate(overlap)
                took = decode.finished_at - decode.prefilled_at
                spent += took
                tokens += db * (new - 1)
                step = took / (new - 1)
                new = int(min(most_new, max(8, (seconds / 2 - spent) / step)))
            decode_tps = tokens / spent
            result = {
                "model": f"{name} shape, random weights",
                "dtype": str(engine.dtype).removeprefix("torch."),
                "attention_backend": type(engine.attn_backend).__name__,
                "cuda_graphs": bool(engine.graph_runner and engine.graph_runner.graphs),
                "overlap": overlap,
                "prefill": {"tokens_per_s": round(prefill_tps, 1), "batch": pb,
                            "prompt_tokens": plen, "steps": runs},
                "decode": {"tokens_per_s": round(decode_tps, 1), "batch": db,
                           "ms_per_step": round(1000 * spent / (tokens / db), 3),
                           "steps": tokens // db},
            }  # fmt: skip
            del engine, prefill, decode
    except Exception as exc:  # the probe cannot tell a failure the checks did not
        not_checked.append({"name": "throughput", "reason": f"{type(exc).__name__}: {exc}"})
        return None
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return result
