from __future__ import annotations

import pytest
import torch

from k3run.layers.norm import GatedRMSNorm, RMSNorm
from k3run.testing import assert_close


def _rms_ref64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.double()


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rmsnorm_fp32_matches_fp64_formula(eps: float) -> None:
    norm = RMSNorm(37, eps=eps)
    norm.weight.weight_loader(norm.weight, torch.randn(37))
    x = torch.randn(5, 3, 37) * 3.0
    # fp32: a handful of roundings on O(1) values, far below 1e-6 relative
    assert_close("rmsnorm fp32", _rms_ref64(x, norm.weight, eps), norm(x), rtol=1e-6)
    assert norm(x).dtype == torch.float32


def test_rmsnorm_eps_matters_for_small_inputs() -> None:
    x = torch.randn(4, 16) * 1e-3
    a = RMSNorm(16, eps=1e-5)(x)
    b = RMSNorm(16, eps=1e-6)(x)
    assert_close("eps=1e-6", _rms_ref64(x, torch.ones(16), 1e-6), b, rtol=1e-6)
    assert (a - b).abs().max() > 1e-2


def test_rmsnorm_bf16_input_bf16_output() -> None:
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.weight_loader(norm.weight, torch.randn(64))
    x = torch.randn(9, 64).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    # fp32 math, one final rounding to bf16 (8 mantissa bits): relative error <= 2^-9 per element
    assert_close("rmsnorm bf16", _rms_ref64(x.float(), norm.weight, 1e-5), y, rtol=2**-9)


def test_gated_rmsnorm_matches_formula() -> None:
    norm = GatedRMSNorm(24, eps=1e-5)
    norm.weight.weight_loader(norm.weight, torch.randn(24))
    x, g = torch.randn(7, 2, 24), torch.randn(7, 2, 24) * 4
    ref = _rms_ref64(x, norm.weight, 1e-5) * torch.sigmoid(g.double())
    assert_close("gated rmsnorm", ref, norm(x, g), rtol=1e-6)


def test_shape_errors_are_named() -> None:
    with pytest.raises(ValueError, match="expected last dim 8"):
        RMSNorm(8)(torch.randn(2, 9))
    with pytest.raises(ValueError, match="same shape"):
        GatedRMSNorm(8)(torch.randn(2, 8), torch.randn(2, 7))
    norm = RMSNorm(8)
    with pytest.raises(ValueError, match=r"expected shape \(8,\), got \(9,\)"):
        norm.weight.weight_loader(norm.weight, torch.randn(9))
