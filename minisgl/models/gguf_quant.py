"""The GGUF's own quantized weights, as `GroupQuant` matrices (minisgl.models.quant).

Contract: `iter_gguf_weights(gguf_path, num_heads, num_kv_heads)` yields (Hugging Face name, weight) for every
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

Everything is read from the memory-mapped file once and copied out, so the mapping is
dropped as soon as the weights are packed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .gguf import hf_tensor_name, unpermute_qk
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

    `data` holds the tensor's bytes as uint8 rows (one per row of the weight), `shape` is
    its (out, in) shape, outermost first."""
    if kind in FLOAT_TYPES:
        if kind == "BF16":  # the upper half of a float32
            floats = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            floats = data.view(np.float32 if kind == "F32" else np.float16)
        return torch.from_numpy(np.array(floats, dtype=np.float32).reshape(shape))
    if kind in REQUANTIZED_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(np.asarray(data), GGMLQuantizationType[kind]).reshape(shape)
        return GroupQuant.from_float(torch.from_numpy(np.array(w, dtype=np.float32)), bits=8)
    if kind not in EXACT_TYPES:
        raise UnsupportedGGUFType(
            f"GGUF tensor {name} is {kind}, which --quantization gguf cannot compute with "
            f"(it reads {', '.join(EXACT_TYPES + REQUANTIZED_TYPES)}, and float tensors); "
            "--quantization none dequantizes it to float32 instead"
        )
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    N, K = shape
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)  # (nb, type_size)
    codes, scale, offset, bits = _blocks_to_groups(kind, blocks)
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(N, K)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(N, K // 32)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(N, K // 32)),
        bits,
    )


def _permuted(weight, n_head: int):
    """Undo llama.cpp's q/k row permutation on a float tensor or a GroupQuant."""
    rows = unpermute_qk(np.arange(weight.shape[0]).reshape(-1, 1), n_head).reshape(-1)
    return weight[torch.from_numpy(rows)]


# GGUF metadata value types: fixed sizes in bytes (8: string, 9: array are variable)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Cursor:
    """Little-endian reads over the file's bytes (a memory map)."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.read("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype == 8:
            n = self.read("Q")  # (not `pos += read()`: that adds to the old pos)
            self.pos += n
        elif vtype == 9:
            etype, count = self.read("IQ")
            if etype in _VALUE_SIZES:
                self.pos += _VALUE_SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            self.pos += _VALUE_SIZES[vtype]


def read_tensor_infos(buf) -> tuple[list[tuple[str, int, tuple[int, ...], int]], int]:
    """The tensor directory of a GGUF file (v2 or v3) in `buf`: [(name, ggml type id,
    shape outermost first, byte offset in the data section)], and where that section
    starts. Metadata is skipped, not parsed: the folder's config.json already holds it
    (gguf's GGUFReader builds every tokenizer string as a numpy object, seconds here)."""
    cur = _Cursor(buf)
    magic, version, n_tensors, n_kv = cur.read("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"not a GGUF file of version 2 or later (magic {magic!r}, v{version})")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.read("I")
        if key == "general.alignment" and vtype == 4:
            alignment = cur.read("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.read(f"{cur.read('I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        qtype, offset = cur.read("IQ")
        infos.append((name, qtype, tuple(reversed(dims)), offset))
    return infos, -(-cur.pos // alignment) * alignment


def iter_gguf_weights(
    gguf_path: Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, GroupQuant | torch.Tensor]]:
    """(Hugging Face name, GroupQuant or float32 tensor) for every tensor of the file;
    the head counts undo llama.cpp's q/k row permutation."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    infos, data_start = read_tensor_infos(buf)
    for gguf_name, type_id, shape, offset in infos:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * type_size
        start = data_start + offset
        rows = buf[start : start + row_bytes * int(np.prod(shape[:-1]))].reshape(-1, row_bytes)
        name = hf_tensor_name(gguf_name)
        weight = gguf_tensor_weight(gguf_name, qtype.name, rows, shape)
        if name.endswith("q_proj.weight"):
            weight = _permuted(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = _permuted(weight, num_kv_heads)
        yield name, weight
    del buf  # the mapping goes with the last view of it: nothing of the file stays mapped
