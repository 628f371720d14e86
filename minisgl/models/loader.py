"""A `CausalLM` with its weights, in the form `--quantization` asks for.

Contract:
- `resolve_quantization(requested, model_dir, device)` -> "gguf", "none" or "int8".
  Unset (None): "gguf" when the model folder links the GGUF file it was converted from
  (`model.gguf`, written by gguf.py) and the device is a CPU, else "none". A combination
  that cannot run raises ValueError saying why in one line.
- `load_model(...)` returns the model on `device` in eval mode, no parameter requiring grad:
  - "none": float weights from the checkpoint (or random, `dummy_weights`), as before;
  - "gguf": the GGUF's own blocks (gguf_quant.py) packed into `Int4Linear`s; no float
    copy of a quantized matrix is ever made (the linears are placeholders on "meta" until
    their packed weights arrive); where a second core is free (minisgl.utils.split's
    `helper_thread_pays`) they take batched steps' rows on two threads. The embedding reads
    its rows out of the LM head's packed weights when the two are tied, else out of its own;
  - "int8": the float model loaded, then every linear rounded to `Int8Linear` (per output
    channel) and its float weight dropped; the embedding as above.
- Tensor parallelism: each rank's slices are taken by `CausalLM._rank_slice` from float
  tensors and `GroupQuant`s alike, before packing.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from minisgl.distributed import TPInfo
from minisgl.utils.split import helper_thread_pays

from .config import ModelConfig
from .decoder import _FUSED, CausalLM, VocabEmbedding
from .layers import Linear
from .quant import GroupQuant, Int4Linear, Int8Linear, quantized_kernels_available
from .weight import init_dummy_weights, iter_checkpoint

QUANTIZATIONS = ("gguf", "none", "int8")
GGUF_LINK = "model.gguf"  # in a folder converted from a GGUF: a link to that file


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model folder came from, if it links one."""
    path = Path(model_dir) / GGUF_LINK
    return path if path.is_file() else None


def resolve_quantization(requested: str | None, model_dir: Path, device: torch.device) -> str:
    source = gguf_source(model_dir)
    if requested is None:
        cpu = device.type == "cpu" and quantized_kernels_available()
        return "gguf" if source is not None and cpu else "none"
    if requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}; choose {', '.join(QUANTIZATIONS)}")
    if requested == "none":
        return requested
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {requested} runs on the CPU only (PyTorch's CPU int4/int8 "
            f"weight-only kernels); on {device.type} use --quantization none"
        )
    if not quantized_kernels_available():
        raise ValueError(f"--quantization {requested}: this torch lacks the CPU int4/int8 kernels")
    if requested == "gguf" and source is None:
        raise ValueError(
            f"--quantization gguf needs a model converted from a GGUF file; {Path(model_dir).name} "
            "has float weights (--quantization int8 rounds them to int8 at load)"
        )
    return requested


class QuantEmbedding(VocabEmbedding):
    """The vocabulary-parallel embedding with its rows read out of a quantized linear's
    weights (`table.rows`), dequantized per lookup: no float table is kept."""

    def __init__(self, rows: int, start: int, tp: TPInfo, table: nn.Module, dtype) -> None:
        nn.Module.__init__(self)
        self.rows, self.start, self.tp, self.dtype = rows, start, tp, dtype
        self.table = table  # the LM head itself when tied: one set of weights for both

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).to(self.dtype)


def load_model(
    config: ModelConfig,
    tp: TPInfo,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
    dummy_weights: bool = False,
    seed: int = 0,
) -> CausalLM:
    if quantization == "gguf":
        if dummy_weights:
            raise ValueError("--dummy-weights has no GGUF blocks: use --quantization none or int8")
        from .gguf_quant import iter_gguf_weights

        weights = iter_gguf_weights(gguf_source(model_dir), config.num_heads, config.num_kv_heads)
        model = _load_gguf(config, tp, device, dtype, weights)
        release_freed_memory()  # the conversion's temporaries, hundreds of MB, to the OS
    else:
        model = _load_float(config, tp, device, dtype, model_dir, dummy_weights, seed)
        if quantization == "int8":
            _round_to_int8(model, dtype)
            release_freed_memory()  # the float weights
    # no parameter asks for gradients: a forward run outside inference mode then records no
    # history either (the engine runs every forward inside it)
    return model.requires_grad_(False).eval()


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim). Loading allocates and
    frees hundreds of MB of temporaries; glibc keeps freed memory in its heap, where it
    would count as the process's memory (RSS) at rest. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _new_model(config: ModelConfig, tp: TPInfo) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config, tp)


def _materialize(model: CausalLM, device: torch.device, dtype: torch.dtype) -> CausalLM:
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.build(device)
    return model


def _load_float(config, tp, device, dtype, model_dir, dummy_weights, seed) -> CausalLM:
    model = _materialize(_new_model(config, tp), device, dtype)
    model.tie_weights()
    if dummy_weights:
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iter_checkpoint(model_dir, lazy=tp.size > 1))
    return model


@torch.no_grad()
def _round_to_int8(model: CausalLM, dtype: torch.dtype) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            bias = None if module.bias is None else module.bias.detach()
            model.set_submodule(name, Int8Linear(module.weight.detach(), bias))
    emb = model.model.embed_tokens
    table = model.lm_head if model.config.tie_word_embeddings else Int8Linear(emb.weight.detach())
    model.model.embed_tokens = QuantEmbedding(emb.rows, emb.start, emb.tp, table, dtype)


@torch.no_grad()
def _load_gguf(
    config: ModelConfig,
    tp: TPInfo,
    device: torch.device,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, GroupQuant | torch.Tensor]],
) -> CausalLM:
    model = _new_model(config, tp)
    emb = model.model.embed_tokens
    # every linear and the embedding become placeholders: nothing of theirs is allocated
    shapes = {n: (m.out_features, m.in_features) for n, m in model.named_modules()
              if isinstance(m, Linear)}  # fmt: skip
    for name in shapes:
        model.set_submodule(name, nn.Identity())
    del emb.weight  # the embedding keeps its slice (rows, start) for _rank_slice
    model = _materialize(model, device, dtype)  # only the norms are left to allocate

    parts: dict[str, dict[int, GroupQuant | torch.Tensor]] = defaultdict(dict)
    rest = []
    for name, tensor in weights:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        fused = next(((f, t) for f, t in _FUSED.items() if f in name), None)
        module, shard = name.rpartition(".")[0], 0
        if fused is not None:
            module, shard = name.replace(fused[0], fused[1][0]).rpartition(".")[0], fused[1][1]
        if module in shapes or module == "model.embed_tokens":
            parts[module][shard] = model._rank_slice(name, tensor)
        else:
            rest.append((name, tensor))
    model.load_weights(rest)  # the norms; it checks that none is missing

    embedding = parts.pop("model.embed_tokens", {}).get(0)
    if embedding is None:
        raise ValueError("checkpoint is missing weights: ['model.embed_tokens.weight']")
    embedding = _pad_rows(embedding, emb.rows)
    if config.tie_word_embeddings:
        parts["lm_head"] = {0: embedding}
    two_threads = helper_thread_pays(device)
    for name, (out_features, in_features) in shapes.items():
        model.set_submodule(name, _linear(name, parts.pop(name, {}), out_features, in_features,
                                          dtype, device, two_threads))  # fmt: skip
    if parts:
        raise ValueError(f"checkpoint weights with no place in the model: {sorted(parts)[:8]}")

    if config.tie_word_embeddings:
        table = model.lm_head
    elif isinstance(embedding, GroupQuant):
        table = Int4Linear(embedding)
    else:
        table = None
    if isinstance(table, (Int4Linear, Int8Linear)):
        model.model.embed_tokens = QuantEmbedding(emb.rows, emb.start, tp, table, dtype)
    else:  # a float embedding (tied to a float LM head, or on its own)
        plain = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        plain.weight = (
            table.weight
            if table is not None
            else nn.Parameter(embedding.to(device, dtype), requires_grad=False)
        )
        model.model.embed_tokens = plain
    return model


def _pad_rows(weight: GroupQuant | torch.Tensor, rows: int):
    """The vocabulary padded to a multiple of the ranks: zero rows past it."""
    if isinstance(weight, GroupQuant):
        return weight.pad_rows(rows)
    return torch.nn.functional.pad(weight, (0, 0, 0, rows - weight.shape[0]))


def _linear(name: str, shards: dict, out_features: int, in_features: int, dtype, device,
            two_threads: bool = False):  # fmt: skip
    """The module for one (fused) linear from its checkpoint shards, in order (a quantized
    one on two threads for batched steps when `two_threads`)."""
    count = 3 if ".qkv_proj" in name else 2 if ".gate_up_proj" in name else 1
    if sorted(shards) != list(range(count)):
        raise ValueError(f"checkpoint is missing weights of {name}")
    pieces = [shards[i] for i in range(count)]
    if all(isinstance(p, GroupQuant) for p in pieces):
        weight = GroupQuant.cat(pieces)
    else:  # float matrices (a GGUF may keep some in F16/F32): computed as floats
        weight = torch.cat([p.dequantize() if isinstance(p, GroupQuant) else p for p in pieces])
    if tuple(weight.shape) != (out_features, in_features):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(weight.shape)} != model {(out_features, in_features)}"
        )
    if isinstance(weight, GroupQuant):
        layer = Int4Linear(weight)
        layer.two_threads = two_threads
        return layer
    layer = Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    layer.weight.requires_grad_(False).copy_(weight)
    return layer
