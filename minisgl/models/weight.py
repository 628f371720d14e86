"""Weights into a model: from checkpoint files, or random values of the real shapes.

Contract:
- `iter_checkpoint(model_dir)` yields (Hugging Face name, tensor) pairs from every
  `*.safetensors` file (sharded or not), or `pytorch_model*.bin` when no safetensors exist.
  With `lazy=True` a safetensors entry is a slice object instead: indexing it reads only
  that part of the file (a tensor-parallel rank loads only its shard).
- `init_dummy_weights(model)` fills a model with small random values (for benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn


def iter_checkpoint(model_dir: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
        return
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {model_dir}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the real shapes: norms at 1, everything else small and centred."""
    gen: torch.Generator | None = None
    for name, param in model.named_parameters():
        if gen is None:  # generate where the parameters live: fast on a GPU
            gen = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
