"""What a decode forward's autograd history would hold, on the CPU: the graph runner's case.

The decode graph runner writes each forward's logits into rows of one fixed buffer (engine/
graph.py). Run with autograd on over parameters that require grad (as capture once ran),
the buffer keeps the history of every such write: the activations each forward saved for a
backward pass that never comes. This runs three forwards (capture's two warm-ups and the
recorded one) of a Qwen3-0.6B-shaped model with fewer layers, random weights, the torch
attention backend, both ways, and sums the distinct storages the buffer's history saves,
less the weights and the KV pool (which live on anyway):

    python benchmarks/capture_memory.py --layers 2 --rows 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from minisgl.attention import AttentionContext, create_attention_backend
from minisgl.distributed import TPInfo
from minisgl.engine.inputs import StepInputBuilder
from minisgl.kvcache import KVCachePool
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model

CONFIG = Path(__file__).with_name("configs") / "qwen3-0.6b" / "config.json"


def saved_bytes(t: torch.Tensor, live: set[int]) -> int:
    """Bytes of the distinct storages `t`'s autograd history saves, less those in `live`."""
    seen, stack, storages = set(), [t.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name, None)
                for x in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(x, torch.Tensor):
                        storage = x.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        stack += [n for n, _ in node.next_functions]
    return sum(n for ptr, n in storages.items() if ptr not in live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    layers, rows = args.layers, args.rows
    config = json.loads(CONFIG.read_text()) | {"num_hidden_layers": layers}
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    c, cpu = ModelConfig.from_dir(folder), torch.device("cpu")
    model = load_model(c, TPInfo(0, 1), folder, cpu, torch.float32, dummy_weights=True)
    pool = KVCachePool(layers, 64, 16, c.num_kv_heads, c.head_dim, torch.float32, cpu)
    backend = create_attention_backend("torch", pool, c.num_heads, c.head_dim, cpu)
    buf = StepInputBuilder(rows, 4, 16, pool.scratch_page, cpu, rows).decode_buffers
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    live |= {pool.k.untyped_storage().data_ptr(), pool.v.untyped_storage().data_ptr()}
    for autograd in (True, False):
        model.requires_grad_(autograd)
        logits = torch.zeros(2 * rows, c.vocab_size)  # a larger bucket's rows too
        with torch.inference_mode(not autograd):
            for _ in range(3):
                ctx = AttentionContext(backend, backend.prepare(buf.info(rows)))
                logits[:rows] = model.logits(model(buf.input_ids, buf.positions, ctx))
        held = saved_bytes(logits, live) if logits.grad_fn is not None else 0
        how = "autograd on, weights requiring grad" if autograd else "inference mode"
        name = type(logits.grad_fn).__name__
        print(f"{how}: {held / 2**20:.1f} MiB held by the logits buffer (grad_fn {name})")


if __name__ == "__main__":
    main()
