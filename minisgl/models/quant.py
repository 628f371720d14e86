"""Weight-only quantized linear layers for the CPU: integer weights, float activations.

Contract:
- `GroupQuant` is a weight matrix (N out, K in) as integer codes with one scale and one
  offset per group of 32 inputs: w[n, k] = scale[n, k // 32] * code[n, k] + offset[n, k // 32].
  Codes are 4-bit (0..15) or 8-bit (0..255). This is how GGUF stores Q4_0, Q4_1, Q4_K, Q5_*,
  Q8_0 (gguf_quant.py turns their blocks into it, exactly); it slices like a tensor
  (`[a:b]` rows, `[:, a:b]` columns at group boundaries) so tensor parallelism takes each
  rank's part with the same code as for float tensors.
- `Int4Linear(gq)` packs it for PyTorch's CPU kernel `aten._weight_int4pack_mm_for_cpu`
  (int4 codes, a bf16 scale and zero per group of 32): 4-bit groups directly, 8-bit groups
  as two 4-bit halves, code = 16 * high + low, whose two products the kernel sums in one
  call (the input repeated: [x | x] times [high | low]). The packed codes are the only copy
  of the weight; `rows(ids)` dequantizes single rows out of it (embedding lookups when the
  LM head shares the embedding).
- `Int8Linear(w)` is per-output-channel symmetric int8 built from a float weight at load
  (`--quantization int8`, any checkpoint), run by `aten._weight_int8pack_mm`.
- Both take and return the model's activation dtype (float32 on a CPU): the input is
  rounded to bf16 for the kernel, which accumulates in float32 and rounds its output to
  bf16 (the kernels are vectorized for bf16 only; float32 runs a scalar loop about 25x
  slower). Norms, attention, the residual stream and the KV cache stay float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.utils.split import both, by_rows, worth_splitting

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per scale: GGUF's block size, the kernel's smallest group
# From this many input rows on (prefill), dequantizing the weight to bf16 for one GEMM
# beats the int4 kernel, which re-unpacks the codes for every 4 rows (benchmarks/RESULTS.md,
# "Why the CPU path is shaped as it is", has the measurements)
DEQUANT_ROWS = 96
# A step from DEQUANT_ROWS on dequantizes every weight once, whatever its rows: a prompt
# chunk beside decodes takes the step to PREFILL_ROWS, where that fixed cost is a small
# part of the step (see `prefill_rows`)
PREFILL_ROWS = 4 * DEQUANT_ROWS
BLOCK_N = 64  # output rows are padded to a multiple of the CPU kernel's widest block
_PACK_ROWS = 4096  # rows packed per call: bounds the int32 temporary the packer needs


@dataclass
class GroupQuant:
    """w[n, k] = scale[n, k // 32] * codes[n, k] + offset[n, k // 32]."""

    codes: torch.Tensor  # (N, K) uint8: 0..15 when bits == 4, 0..255 when bits == 8
    scale: torch.Tensor  # (N, K // 32) float32
    offset: torch.Tensor  # (N, K // 32) float32
    bits: int  # 4 or 8

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, exactly scale * code + offset."""
        expand = self.codes.shape[1] // self.scale.shape[1]
        scale = self.scale.repeat_interleave(expand, dim=1)
        offset = self.offset.repeat_interleave(expand, dim=1)
        return self.codes.float() * scale + offset

    def __getitem__(self, index) -> GroupQuant:
        """`[:]`, `[a:b]` (rows) or `[:, a:b]` (columns, at group boundaries)."""
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        if cols != slice(None):
            start, stop, _ = cols.indices(self.codes.shape[1])
            if start % GROUP or stop % GROUP:
                raise ValueError(
                    f"columns {start}:{stop} cut a group of {GROUP}: this weight cannot be "
                    "split over these ranks"
                )
            groups = slice(start // GROUP, stop // GROUP)
        else:
            groups = cols
        return GroupQuant(
            self.codes[rows, cols], self.scale[rows, groups], self.offset[rows, groups], self.bits
        )

    @classmethod
    def cat(cls, parts: list[GroupQuant]) -> GroupQuant:
        """Stack along N; 4-bit parts next to 8-bit ones become 8-bit (the same codes)."""
        return cls(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            max(p.bits for p in parts),
        )

    def pad_rows(self, rows: int) -> GroupQuant:
        """Zero rows appended up to `rows` (a vocabulary padded for tensor parallelism)."""
        extra = rows - self.codes.shape[0]
        if extra <= 0:
            return self
        return GroupQuant(
            F.pad(self.codes, (0, 0, 0, extra)),
            F.pad(self.scale, (0, 0, 0, extra)),
            F.pad(self.offset, (0, 0, 0, extra)),
            self.bits,
        )

    @classmethod
    def from_float(cls, w: torch.Tensor, bits: int = 8) -> GroupQuant:
        """Round a float (N, K) weight to codes between each group's min and max."""
        N, K = w.shape
        groups = w.float().reshape(N, K // GROUP, GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = (hi - lo) / (2**bits - 1)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = ((groups - lo[..., None]) * inv[..., None]).round().clamp(0, 2**bits - 1)
        return cls(codes.reshape(N, K).to(torch.uint8), scale, lo, bits)


def _bf16_input(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16)


class Int4Linear(nn.Module):
    """y = x @ w.T (+ bias) with w held as packed int4 codes and bf16 scales and zeros."""

    def __init__(self, gq: GroupQuant, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        N, K = gq.shape
        if K % GROUP:
            raise ValueError(f"in_features {K} is not a multiple of {GROUP}")
        self.in_features, self.out_features, self.bits = K, N, gq.bits
        # the kernel's dequantization: (code - 8) * scale + zero
        if gq.bits == 4:
            codes, scales, zeros = gq.codes, gq.scale, gq.offset + 8 * gq.scale
        else:  # code = 16 * high + low: high's scale is 16x, the offset rides on it
            codes = torch.cat([gq.codes >> 4, gq.codes & 15], dim=1)  # (N, 2K)
            scales = torch.cat([16 * gq.scale, gq.scale], dim=1)
            zeros = torch.cat([gq.offset + 128 * gq.scale, 8 * gq.scale], dim=1)
        pad = -N % BLOCK_N
        codes = F.pad(codes, (0, 0, 0, pad))
        self.register_buffer("packed", _pack_int4(codes))  # (N_pad, K' / 2) uint8, opaque
        sz = torch.stack([scales, zeros], dim=-1)  # (N, G', 2)
        sz = F.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()  # (G', N_pad, 2)
        self.register_buffer("scale_zeros", sz.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    # set by the loader where a second core is free (minisgl.utils.split): batched steps'
    # rows in two halves
    two_threads = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = _bf16_input(x)  # (M, K)
        split = self.two_threads and worth_splitting(xb.shape[0], self.packed.numel() * 2)
        if xb.shape[0] >= DEQUANT_ROWS:  # prefill: a bf16 GEMM on the weight dequantized
            n = self.packed.shape[0] // 2 // BLOCK_N * BLOCK_N  # whole blocks of rows
            if split and n:  # each thread dequantizes and multiplies by half the output rows
                y = torch.cat(
                    both(
                        partial(self._dequant_mm, xb, 0, n),
                        partial(self._dequant_mm, xb, n, self.out_features),
                    ),
                    1,
                )
            else:
                y = self._dequant_mm(xb, 0, self.out_features)
        else:
            if self.bits == 8:
                xb = torch.cat([xb, xb], dim=1)  # (M, 2K): the high and the low halves
            y = by_rows(self._int4_mm, xb) if split else self._int4_mm(xb)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _dequant_mm(self, xb: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return F.linear(xb, self.dequantize_bf16(start, stop))

    def _int4_mm(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scale_zeros)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows `ids` (T,) of the weight: (T, K), computed in float32."""
        T = ids.shape[0]
        codes = _LAYOUT.unpack(self.packed, ids).view(T, -1, GROUP)  # (T, G', 32) 0..15
        sz = self.scale_zeros[:, ids].float().transpose(0, 1)  # (T, G', 2)
        w = (codes.float() - 8).mul_(sz[..., :1]).add_(sz[..., 1:]).view(T, -1)
        if self.bits == 8:
            w = w[:, : self.in_features] + w[:, self.in_features :]
        return w.to(dtype)

    def dequantize_bf16(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (start a multiple of BLOCK_N) of the weight (N, K) in bf16, a
        temporary for one GEMM: the transposed view of a (K, rows) tensor, the layout the
        packed codes unpack into fastest (output rows side by side, so one scale and zero
        per group broadcast along contiguous rows)."""
        stop = self.out_features if stop is None else stop
        end = min(-(-stop // BLOCK_N) * BLOCK_N, self.packed.shape[0])  # whole blocks
        codes = _LAYOUT.unpack_all_t(self.packed[start:end])  # (K', rows) 0..15
        N = codes.shape[1]
        s, z = self.scale_zeros[:, start:end].float().unbind(-1)  # (G', rows) each
        if self.bits == 4:  # (code - 8) * s + z = code * s + (z - 8 s)
            offset = z - 8 * s
        else:  # the halves' sum: (16 high + low) * s_low + both offsets, as s_high = 16 s_low
            K, G = self.in_features, self.in_features // GROUP
            codes = (codes[:K] << 4).bitwise_or_(codes[K:])  # (K, rows) 0..255
            offset = z[:G] + z[G:] - 8 * (s[:G] + s[G:])
            s = s[G:]
        # one multiply-add per weight in float32, rounded once to bf16: the weight the int4
        # kernel multiplies by, to within bf16's step. (Rounding the offset to bf16 first,
        # as this did, tripled the mean error; KV computed here and by the kernel then
        # differed enough that a prompt reusing the other path's cached prefix answered
        # "What is the capital of France?" with "L'Étoile" instead of "The ... Paris".)
        w = torch.addcmul(offset[:, None], codes.view(-1, GROUP, N), s[:, None])  # (G, 32, N)
        return w.to(torch.bfloat16).view(-1, N)[:, : stop - start].t()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, codes={self.bits}-bit"


class Int8Linear(nn.Module):
    """y = x @ w.T (+ bias) with w as int8 per output channel: w[n] = scale[n] * q[n]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1) / 127  # (N,)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight_int8", q)  # (N, K): a plain layout, rows readable
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_bf16_input(x), self.weight_int8, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_int8[ids].float() * self.scales[ids].float()[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel"


# logits recomputed exactly per row: more than the most alternatives a request may ask for
EXACT_TOP = 64


def exact_top_logits(head: nn.Module, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (B, V) from a quantized LM head, its top EXACT_TOP of each row recomputed
    in float32 from the float32 hidden rows `x` (B, K) and the dequantized weight rows.

    The kernels round their output to bf16: 8 significant bits, steps of 1/16 at a logit
    of 10, enough to tie or swap the top tokens (greedy picks, logprobs). The true argmax
    is always among the EXACT_TOP largest rounded logits unless that many lie within two
    rounding steps of it; the rest of the row keeps the rounded values."""
    k = min(EXACT_TOP, logits.shape[1])
    top = logits.topk(k, dim=1).indices  # (B, k)
    w = head.rows(top.reshape(-1)).view(*top.shape, -1)  # (B, k, K)
    exact = torch.bmm(w, x.float().unsqueeze(2)).squeeze(2)  # (B, k)
    return logits.scatter_(1, top, exact)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15, N a multiple of 64 -> the CPU kernel's packed uint8 layout,
    BLOCK_N rows at a time (packing is per block of rows)."""
    chunks = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i : i + _PACK_ROWS].int(), 1)
        for i in range(0, codes.shape[0], _PACK_ROWS)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class _PackedLayout:
    """Where the CPU packer puts code (n, k), so rows can be read back without a copy.

    The packer (aten/src/ATen/native/cpu/int4mm_kernel.cpp) works on blocks of BLOCK_N
    rows, K bytes-rows of BLOCK_N / 2 bytes each; which row lands in which byte and nibble
    depends on the SIMD width it was built for (AVX512: 64 rows, r and r + 32 share a byte;
    AVX2: 32 rows, r and r + 16; otherwise 32 rows, r and r + 1). Rather than trust the
    CPU's name, the layout is found once by packing a probe and checking each candidate.
    """

    # (rows per block, whether rows r and r + 1 share a byte; else r and r + block / 2 do)
    CANDIDATES = ((64, False), (32, False), (32, True))

    def __init__(self) -> None:
        self._found: tuple[int, bool] | None = None

    def _find(self) -> tuple[int, bool]:
        if self._found is None:
            gen = torch.Generator().manual_seed(0)
            probe = torch.randint(0, 16, (2 * BLOCK_N, 2 * GROUP), generator=gen)
            packed = _pack_int4(probe)
            ids = torch.arange(probe.shape[0])
            want = probe.to(torch.uint8)
            for candidate in self.CANDIDATES:
                if torch.equal(self._unpack(candidate, packed, ids), want) and torch.equal(
                    self._unpack_all_t(candidate, packed).t(), want
                ):
                    self._found = candidate
                    break
            else:
                raise RuntimeError("unknown int4 packing layout of this torch build")
        return self._found

    @staticmethod
    def _unpack(candidate: tuple[int, bool], packed: torch.Tensor, ids: torch.Tensor):
        block, paired = candidate
        blocks = packed.view(packed.shape[0] // block, -1, block // 2)  # (NB, K, block / 2)
        r = ids % block
        byte, shift = (
            (r // 2, 4 * (r % 2)) if paired else (r % (block // 2), 4 * (r // (block // 2)))
        )
        b = blocks[ids // block, :, byte]  # (T, K)
        return (b >> shift[:, None].to(torch.uint8)) & 15

    @staticmethod
    def _unpack_all_t(candidate: tuple[int, bool], packed: torch.Tensor) -> torch.Tensor:
        block, paired = candidate
        N, half = packed.shape[0], block // 2
        if paired:  # byte j of a block row: rows 2j (low nibble) and 2j + 1 (high)
            src = packed.view(N // block, -1, half).transpose(0, 1)  # (K, NB, block / 2)
            out = torch.empty(*src.shape, 2, dtype=torch.uint8)  # (K, NB, block / 2, 2)
            lo, hi, mask = out[..., 0], out[..., 1], 15
        else:  # byte j: rows j (low) and j + block / 2 (high), so 8 bytes at a time
            words = packed.reshape(-1).view(torch.int64)
            src = words.view(N // block, -1, half // 8).transpose(0, 1)  # (K, NB, block / 16)
            out = torch.empty(src.shape[0], src.shape[1], 2, src.shape[2], dtype=torch.int64)
            lo, hi, mask = out[:, :, 0], out[:, :, 1], 0x0F0F0F0F0F0F0F0F
        torch.bitwise_and(src, mask, out=lo)
        torch.bitwise_and(src >> 4, mask, out=hi)
        return out.view(torch.uint8).view(src.shape[0], N)  # (K, N)

    def unpack(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Codes of rows `ids`: (T, K) uint8."""
        return self._unpack(self._find(), packed, ids)

    def unpack_all_t(self, packed: torch.Tensor) -> torch.Tensor:
        """Codes of every row, transposed: (K, N) uint8, row k the k-th code of each row."""
        return self._unpack_all_t(self._find(), packed)


_LAYOUT = _PackedLayout()


def prefill_rows(model: nn.Module) -> int:
    """The rows a step of `model` should reach when it carries a prompt chunk beside decodes:
    PREFILL_ROWS where any projection is `Int4Linear`, 1 where none is (float and int8
    weights cost about the same per row at any size: no cost per step to share).

    Under DEQUANT_ROWS every row of an int4 step rides a kernel that unpacks the codes again
    for every 4 rows, so a prompt token there costs about what a decode token does; from it
    on, the step dequantizes each weight once for a bf16 GEMM, and a chunk that only just
    reaches it pays that whole cost for a few dozen prompt tokens."""
    return PREFILL_ROWS if any(isinstance(m, Int4Linear) for m in model.modules()) else 1


def quantized_kernels_available() -> bool:
    """Whether this torch has the CPU int4/int8 weight-only kernels."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_weight_int8pack_mm")
