"""The GGUF's own quantized weights, as `GroupQuant` matrices (minisgl.models.quant).

Contract: `iter_gguf_weights(gguf_path)` yields (Hugging Face name, weight) for every
tensor of a llama-architecture GGUF file, the names and llama.cpp's Q/K row permutation
undone as in gguf.py; a weight is a `GroupQuant` for a quantized matrix and a float32
tensor otherwise (norms, and matrices the file keeps in F32/F16/BF16). Types:

- Q4_0, Q4_1, Q4_K (4-bit codes) and Q5_0, Q5_1, Q5_K, Q8_0 (5 and 8-bit codes, held as
  8-bit): exactly the file's values, every block of 32 one group (Q4_K and Q5_K: their
  32-wide sub-blocks, with the 6-bit sub-scales multiplied out);
- Q6_K: its 16-wide sub-blocks do not fit a group of 32, so its values are rounded again
  to 8-bit codes in groups of 32 (an extra error of at most 1/510 of a group's range, a
  quarter of Q6_K's own step);
- anything else (Q2_K, Q3_K, the IQ and TQ types, ...) raises `UnsupportedGGUFType`,
  naming the tensor and its type; `--quantization none` dequantizes those.

Everything is read from the memory-mapped file once and copied out, so the mapping can
be dropped as soon as the weights are packed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .gguf import build_config, hf_tensor_name, unpermute_qk
from .quant import GroupQuant

EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0")
REQUANTIZED_TYPES = ("Q6_K",)
FLOAT_TYPES = ("F32", "F16", "BF16")


class UnsupportedGGUFType(ValueError):
    """A GGUF tensor type that `--quantization gguf` cannot compute with."""


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """(nb, 1) float32 from the float16 at byte offset `at` of each block."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) bytes -> (nb, 32) codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) bytes, a little-endian uint32 -> (nb, 32): bit i of it for element i."""
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, (nb, 8) each."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: (nb, 128) bytes -> (nb, 256): 32 bytes' low nibbles, then their high
    nibbles, four times (sub-blocks 0..7)."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 256)


def _blocks_to_groups(kind: str, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """Blocks (nb, type_size) -> (codes (nb * per, 32) uint8, scale, offset (nb * per,),
    bits), `per` groups of 32 in each block."""
    if kind == "Q4_0":
        d = _f16(b, 0)
        return _nibbles(b[:, 2:18]), d, -8 * d, 4
    if kind == "Q4_1":
        return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), 4
    if kind == "Q8_0":
        d = _f16(b, 0)
        codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 8
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        codes = _nibbles(b[:, at + 4 : at + 20]) | (_high_bits(b[:, at : at + 4]) << 4)
        d = _f16(b, 0)
        return codes, d, (-16 * d if kind == "Q5_0" else _f16(b, 2)), 8
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[:, 4:16])
        codes = _k_nibbles(b[:, 16:144] if kind == "Q4_K" else b[:, 48:176])
        if kind == "Q5_K":  # bit j of each of 32 bytes is the fifth bit of sub-block j
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((qh & 1).reshape(-1, 256) << 4)
        return (
            codes.reshape(-1, 32),
            (d * sc).reshape(-1),
            (-(dmin * mn)).reshape(-1),
            (4 if kind == "Q4_K" else 8),
        )
    raise AssertionError(kind)


def gguf_tensor_weight(name: str, kind: str, data: np.ndarray, shape: tuple[int, ...]):
    """One GGUF tensor -> a GroupQuant (quantized matrix) or a float32 tensor.

    `data` is the reader's array (rows of blocks for a quantized type), `shape` the
    tensor's (out, in) shape, outermost first."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    if kind in FLOAT_TYPES:
        return torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32).reshape(shape))
    if kind in REQUANTIZED_TYPES:
        w = torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32).reshape(shape))
        return GroupQuant.from_float(w, bits=8)
    if kind not in EXACT_TYPES:
        raise UnsupportedGGUFType(
            f"GGUF tensor {name} is {kind}, which --quantization gguf cannot compute with "
            f"(it reads {', '.join(EXACT_TYPES + REQUANTIZED_TYPES)}, and float tensors); "
            "--quantization none dequantizes it to float32 instead"
        )
    N, K = shape
    blocks = np.ascontiguousarray(data).reshape(-1, _type_size(qtype))  # (nb, type_size)
    codes, scale, offset, bits = _blocks_to_groups(kind, blocks)
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(N, K)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(N, K // 32)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(N, K // 32)),
        bits,
    )


def _type_size(qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


def _permuted(weight, n_head: int):
    """Undo llama.cpp's q/k row permutation on a float tensor or a GroupQuant."""
    rows = unpermute_qk(np.arange(weight.shape[0]).reshape(-1, 1), n_head).reshape(-1)
    return weight[torch.from_numpy(rows)]


# --8<-- [start:iter_gguf_weights]
def iter_gguf_weights(gguf_path: Path) -> Iterator[tuple[str, GroupQuant | torch.Tensor]]:
    """(Hugging Face name, GroupQuant or float32 tensor) for every tensor of the file."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = build_config(reader, has_output_weight=has_output)
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        shape = tuple(reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        weight = gguf_tensor_weight(t.name, t.tensor_type.name, t.data, shape)
        if name.endswith("q_proj.weight"):
            weight = _permuted(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = _permuted(weight, config["num_key_value_heads"])
        yield name, weight


# --8<-- [end:iter_gguf_weights]
