"""The CPU fast paths of the model layers: prepacked linear weights and the rotation.

`Linear` must give F.linear's result (to float rounding) with or without its oneDNN path,
follow its weight when it changes, and leave autograd alone. `apply_rotary` must be bit
for bit transformers' rotate-half formula, and `RMSNorm`'s fused float32 op bit for bit
transformers' float32 norm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.models.config import RopeConfig
from minisgl.models.layers import _ONEDNN as ONEDNN
from minisgl.models.layers import (
    Linear,
    RMSNorm,
    RotaryEmbedding,
    _inverse_frequencies,
    apply_rotary,
)


@pytest.mark.parametrize("rows", [1, 3, 16, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = layer(x)
        expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (layer._packed is not None) == ONEDNN  # the oneDNN path ran where it exists


@pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
def test_linear_repacks_when_its_weight_changes() -> None:
    torch.manual_seed(0)
    layer = Linear(32, 48, bias=False)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as load_weights writes
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.zeros(48, 32))  # another tensor, as tying does
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.zeros(4, 48))


def test_linear_keeps_autograd() -> None:
    layer = Linear(8, 4)
    layer(torch.randn(2, 8)).sum().backward()  # grad enabled: F.linear, gradients flow
    assert layer.weight.grad is not None and layer._packed is None


ROPES = {
    "default": RopeConfig(theta=10000.0),
    "llama3": RopeConfig(
        theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64
    ),
}


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_rotation_is_transformers_rotate_half_bit_for_bit(rope) -> None:
    D = 32
    table = RotaryEmbedding(D, 256, rope)
    positions = torch.tensor([0, 5, 77, 255, 3])
    x = torch.randn(len(positions), 6, D)

    # transformers: emb = cat(freqs, freqs); x * cos + rotate_half(x) * sin
    freqs = positions[:, None].float() * _inverse_frequencies(D, rope)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    rotate_half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    expected = x * emb.cos() + rotate_half * emb.sin()
    assert torch.equal(apply_rotary(x, *table.tables(positions, x.dtype)), expected)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_float32_is_transformers_norm_bit_for_bit(rows) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, 576) * 3
    # transformers' LlamaRMSNorm, in float32
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)
        # half precision keeps transformers' order: round, then the weight's product
        xh, wh = x.to(torch.bfloat16), norm.weight.to(torch.bfloat16)
        half = RMSNorm(576, 1e-5).to(torch.bfloat16)
        half.weight.copy_(wh)
        xf = xh.float()
        want = wh * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
        assert torch.equal(half(xh), want)
