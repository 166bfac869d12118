from __future__ import annotations

import pytest
import torch

from k3run.layers.activation import GatedActivation, silu_and_mul, situ_and_mul
from k3run.testing import assert_close


def _situ_ref(x: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """fp64 SiTU from the formula, written independently of the implementation."""
    x64 = x.double()
    d = x.shape[-1] // 2
    g, u = x64[..., :d], x64[..., d:]
    left = beta * torch.tanh(g / beta) / (1 + torch.exp(-g))
    right = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return left * right


def test_silu_and_mul_matches_formula():
    x = torch.randn(7, 2 * 24) * 3
    ref = x[:, :24].double() / (1 + torch.exp(-x[:, :24].double())) * x[:, 24:].double()
    # fp32 math: a few fp32 roundings, relative error ~1e-7
    assert_close("silu_and_mul", ref, silu_and_mul(x), rtol=1e-6)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_and_mul_fp32(linear_beta):
    # spread covers the soft-cap regime (|g| >> 4, |u| >> 25)
    x = torch.randn(9, 2 * 40) * torch.tensor([1.0, 10.0, 60.0]).repeat_interleave(3).unsqueeze(1)
    out = situ_and_mul(x, 4.0, linear_beta)
    assert out.dtype == torch.float32 and out.shape == (9, 40)
    assert_close("situ fp32", _situ_ref(x, 4.0, linear_beta), out, rtol=1e-6)


def test_situ_soft_caps():
    g = torch.tensor([1000.0, -1000.0, 0.5])
    u = torch.tensor([1000.0, 1000.0, 0.5])
    out = situ_and_mul(torch.cat([g, u]).unsqueeze(0), 4.0, 25.0)[0]
    # large positive gate saturates at 4*sigmoid(g) = 4; the up branch saturates at 25
    assert out[0].item() == pytest.approx(100.0, rel=1e-6)
    assert abs(out[1].item()) < 1e-6  # sigmoid(-1000) = 0
    # near zero SiTU is close to SwiGLU: 4 tanh(g/4) = g (1 - g^2/48 + ...)
    assert out[2].item() == pytest.approx(0.5 * torch.sigmoid(torch.tensor(0.5)).item() * 0.5, rel=2e-2)


def test_situ_large_beta_recovers_swiglu():
    x = torch.randn(5, 32)
    assert_close("situ(beta=1e6) vs silu", silu_and_mul(x).double(), situ_and_mul(x, 1e6, None), rtol=1e-6)


def test_situ_bf16_single_rounding():
    x = (torch.randn(64, 2 * 48) * 8).to(torch.bfloat16)
    out = situ_and_mul(x, 4.0, 25.0)
    assert out.dtype == torch.bfloat16
    # fp32 math then one cast to bf16 (8 significant bits): every element within half an ulp, i.e. the unit
    # roundoff 2^-8 relative, of the fp64 value
    ref = _situ_ref(x, 4.0, 25.0)
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    assert rel <= 2**-8 * (1 + 1e-3)


def test_gated_activation_dispatch_and_errors():
    x = torch.randn(3, 16)
    assert torch.equal(GatedActivation("silu")(x), silu_and_mul(x))
    assert torch.equal(GatedActivation("situ", 4.0, 25.0)(x), situ_and_mul(x, 4.0, 25.0))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="gelu"):
        GatedActivation("gelu")
    with pytest.raises(ValueError, match="activation_situ_beta"):
        GatedActivation("situ")
