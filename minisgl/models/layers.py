"""Building blocks of a decoder-only transformer, in plain torch.

Numerics follow Hugging Face's Llama/Qwen implementations (norms in float32, RoPE tables
computed in float32 then cast), so that our greedy tokens match transformers' in float32.
Shapes: T = tokens in the step (all requests flattened), H = query heads, Hkv = KV heads,
D = head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.utils.split import by_rows, worth_splitting

from .config import RopeConfig
from .quant import DEQUANT_ROWS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # one fused op, bit for bit the lines below in float32 (checked in
            # tests/unit/test_torch_backend_layers.py); in half precision the lines below round
            # before the weight's product, as transformers does, and the fused op after it
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 stretches low frequencies by `factor`, keeps high ones, and blends between.
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed (max_positions, D) cos/sin table.

    `tables(positions)` looks up a step's rows once; every layer then applies them with
    `apply_rotary`. The sin table is stored with the sign of rotate-half folded into its
    first half, so that a rotation is x * cos + roll(x) * sin, bit for bit transformers'
    x * cos + rotate_half(x) * sin (negating a factor is exact) in fewer operations."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.build(device=None)

    def build(self, device: torch.device | None) -> None:
        """(Re)compute the float32 tables on `device` (None: the default device). A model
        built on "meta" calls this once it has real storage: to_empty() keeps no values."""
        inv_freq = _inverse_frequencies(self.head_dim, self.rope).to(device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)
        sin = freqs.sin()
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, signed sin: (T, 1, D) each, in `dtype`."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos, sin from `RotaryEmbedding.tables`. roll by D/2 swaps the two
    halves of each head: rotate_half without its negation, which lives in `sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Linear(nn.Linear):
    """nn.Linear that, for float32 inference on a CPU, multiplies by a copy of its weight
    prepacked for oneDNN: torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise,
    the ops torch.compile's CPU weight-freezing pass emits for a linear layer.

    Why: a decode step multiplies a few rows (one per request) by every weight of the
    model. torch's default CPU matmul (MKL sgemm) is slow at that shape, prepacked weights
    markedly faster, prefill-sized matmuls no slower (benchmarks/RESULTS.md). Results differ from F.linear's only by float rounding (summation order), as
    they do between two matmul shapes of F.linear itself.

    The packed copy is made on first use and again whenever the weight changes (another
    tensor, or written in place: its version counter); it is a cache, not module state.
    It doubles the weights' memory. oneDNN keeps a compiled primitive per input shape (a
    soak test saw the server grow with every new token count), so
    only inputs of up to PACKED_ROWS[-1] rows take this path, padded up to one of a few row
    counts: the shapes are bounded and warm after the first steps. Anything else (longer
    prefills, CUDA, other dtypes, autograd) runs F.linear unchanged."""

    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _use_packed(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        key = (w.data_ptr(), 0 if w.is_inference() else w._version)
        if self._packed_key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            self._packed_key = key
        rows = x.shape[0]
        padded = next(b for b in PACKED_ROWS if b >= rows)
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return out[:rows]


# row counts the packed path runs at (inputs are padded up to the next one)
PACKED_ROWS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256]


def _use_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and 0 < x.shape[0] <= PACKED_ROWS[-1]
        and x.is_contiguous()
        and not torch.is_grad_enabled()  # the packed copy has no autograd
        and torch.backends.mkldnn.enabled
    )


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # quantized, with a second core free (minisgl.utils.split): a batch's rows in two
        # halves, one hand-over for the whole block rather than one per projection. Unless
        # the halves would fall under DEQUANT_ROWS while the whole is not (the int4 kernel
        # twice where one dequantized GEMM does): each projection then splits its own work
        rows = x.shape[0]
        if (
            getattr(self.gate_up_proj, "two_threads", False)
            and (rows < DEQUANT_ROWS or rows // 2 >= DEQUANT_ROWS)
            and worth_splitting(rows, 3 * self.intermediate * x.shape[-1])
        ):
            return by_rows(self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
