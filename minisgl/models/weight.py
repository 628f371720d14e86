"""Where weights come from: a local directory, a hub id, or random values of the real shape.

Contract:
- `resolve_model_dir(model)` turns what the user passed to `--model` into a local directory
  holding config.json, the tokenizer and the weights (downloading from the hub only when
  `model` is not a directory). `None` means the embedded default model.
- `iter_checkpoint(model_dir)` yields (Hugging Face name, tensor) pairs from every
  `*.safetensors` file (sharded or not), or `pytorch_model*.bin` when no safetensors exist.
- `init_dummy_weights(model)` fills a model with small random values (for benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn


def resolve_model_dir(model: str | Path | None) -> Path:
    if model is None:
        from .default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf":
        raise ValueError(
            f"{path}: pass a model folder or hub id; GGUF is used for the default model only"
        )
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            str(model),
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:  # network, auth or a wrong id: say which and why in one line
        raise RuntimeError(
            f"could not load model {model!r}: not a local folder and the hub download failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return Path(local)


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
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
