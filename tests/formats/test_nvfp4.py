from __future__ import annotations

import pytest
import torch

from k3run.formats import (
    E2M1_VALUES,
    NVFP4_GROUP,
    dequantize_nvfp4,
    e2m1_decode,
    nvfp4_global_scale,
    nvfp4_qdq,
    quantize_nvfp4,
    unpack_e2m1,
)
from k3run.testing import assert_close, rel_rms_error

GRID = E2M1_VALUES[:8]


def nearest_grid_distance(x: torch.Tensor) -> torch.Tensor:
    """Distance from each |x| (clamped to 6) to the nearest E2M1 magnitude."""
    return (x.abs().clamp(max=6.0).unsqueeze(-1) - GRID).abs().amin(dim=-1)


def check_against_definition(w: torch.Tensor, t, wsc2: float) -> None:
    """Re-derive every scale from the ModelOpt formulas in float64 (independent of the implementation)
    and check the codes are a nearest grid point of W / (scale * wsc2)."""
    n, k = w.shape
    blocks = w.double().reshape(n, k // 16, 16)
    amax = blocks.abs().amax(-1)
    per_block = amax / (6.0 * wsc2)
    per_block[per_block == 0] = 1.0
    want_scale = per_block.clamp(2.0**-9, 448.0).float().to(torch.float8_e4m3fn)
    # fp64 -> fp32 -> fp8 may differ from fp32 arithmetic by a double rounding only at exact fp8 ties
    assert (want_scale.float() != t.weight_scale.float()).float().mean() < 1e-3
    x = blocks / (t.weight_scale.double().unsqueeze(-1) * wsc2)
    q = e2m1_decode(unpack_e2m1(t.weight)).double().reshape(n, k // 16, 16)
    err = (x.abs().clamp(max=6.0) - q.abs()).abs()
    assert torch.all(err <= nearest_grid_distance(x) + 1e-6)
    assert torch.all((q == 0) | (torch.sign(q) == torch.sign(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_shapes_dtypes_and_round_trip(dtype):
    w = torch.randn(48, 96, dtype=dtype)
    t = quantize_nvfp4(w)
    assert t.weight.dtype == torch.uint8 and t.weight.shape == (48, 48)
    assert t.weight_scale.dtype == torch.float8_e4m3fn and t.weight_scale.shape == (48, 6)
    assert t.weight_scale_2.dtype == torch.float32 and t.weight_scale_2.shape == ()
    amax = w.float().abs().max().item()
    assert t.weight_scale_2.item() == torch.tensor(amax, dtype=torch.float32).div(2688.0).item()
    check_against_definition(w.float(), t, t.weight_scale_2.item())
    w_hat = dequantize_nvfp4(*t)
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    # NVFP4 on Gaussian data: E2M1 has one mantissa bit and the 16-block max maps to 6, so most values
    # land where the grid step is 0.5-1 of the block scale; the measured relative RMS is ~0.095
    err = rel_rms_error(w.float(), w_hat)
    assert 0.07 < err < 0.12, err
    assert dequantize_nvfp4(*t, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_block_max_is_reproduced_within_fp8_rounding():
    # the element holding the block amax quantizes to +-6 (or 4 after fp8 round-up of the scale, never
    # lower): checks the amax/(6*wsc2) formula rather than an off-by-constant
    w = torch.randn(32, 64)
    t = quantize_nvfp4(w)
    codes = unpack_e2m1(t.weight).reshape(32, 4, 16)
    idx = w.reshape(32, 4, 16).abs().argmax(-1, keepdim=True)
    top = e2m1_decode(codes.gather(-1, idx)).abs()
    assert torch.all(top >= 4.0) and (top == 6.0).float().mean() > 0.5


def test_zero_blocks_get_scale_one_and_zero_codes():
    w = torch.randn(4, 64)
    w[1, 16:32] = 0.0
    w[3] = 0.0
    t = quantize_nvfp4(w)
    assert t.weight_scale[1, 1].float().item() == 1.0
    assert torch.all(t.weight_scale[3].float() == 1.0)
    assert torch.all(unpack_e2m1(t.weight)[1, 16:32] == 0)
    assert torch.equal(dequantize_nvfp4(*t)[3], torch.zeros(64))


def test_all_zero_tensor_gets_positive_global_scale():
    t = quantize_nvfp4(torch.zeros(2, 32))
    assert t.weight_scale_2.item() == torch.tensor(6.0 / 2688.0, dtype=torch.float32).item()
    assert torch.equal(dequantize_nvfp4(*t), torch.zeros(2, 32))


def test_tiny_block_scale_clamps_to_min_subnormal():
    w = torch.randn(2, 32)
    w[0, :16] = 1e-9  # amax_blk / (6 * wsc2) far below 2^-9
    t = quantize_nvfp4(w)
    assert t.weight_scale[0, 0].float().item() == 2.0**-9
    assert torch.all(unpack_e2m1(t.weight)[0, :16] == 0)


def test_shared_global_scale_larger_than_own_and_saturation():
    w = torch.randn(8, 32)
    own = quantize_nvfp4(w)
    shared = nvfp4_global_scale(w.abs().max() * 4)
    t = quantize_nvfp4(w, shared)
    assert torch.equal(t.weight_scale_2, shared)
    check_against_definition(w, t, shared.item())
    assert rel_rms_error(w, dequantize_nvfp4(*t)) < 0.12
    assert not torch.equal(t.weight_scale.float(), own.weight_scale.float())
    # a global scale 1000x too small: block scales saturate at 448 and codes at +-6
    small = nvfp4_global_scale(w.abs().max() / 1000)
    sat = quantize_nvfp4(w, small)
    assert torch.all(sat.weight_scale.float() == 448.0)
    assert torch.all(e2m1_decode(unpack_e2m1(sat.weight)).abs().amax(-1) == 6.0)


def test_negative_zero_codes_for_small_negatives():
    w = torch.tensor([[6.0, -0.01] + [0.0] * 14])
    t = quantize_nvfp4(w)
    assert unpack_e2m1(t.weight)[0, 1].item() == 8


def test_batched_experts_match_per_expert_calls():
    w = torch.randn(3, 16, 48, dtype=torch.bfloat16)
    t = quantize_nvfp4(w)
    assert t.weight.shape == (3, 16, 24) and t.weight_scale.shape == (3, 16, 3)
    assert t.weight_scale_2.shape == (3,)
    for e in range(3):
        te = quantize_nvfp4(w[e])
        assert torch.equal(t.weight[e], te.weight)
        assert torch.equal(t.weight_scale[e].float(), te.weight_scale.float())
        assert torch.equal(t.weight_scale_2[e], te.weight_scale_2)
    deq = dequantize_nvfp4(*t)
    assert torch.equal(deq[1], dequantize_nvfp4(*quantize_nvfp4(w[1])))
    # one shared scalar for every expert also works
    s = nvfp4_global_scale(w.float().abs().max())
    assert dequantize_nvfp4(*quantize_nvfp4(w, s)).shape == (3, 16, 48)


def test_dequantize_by_hand():
    # codes 1 (0.5) and 15 (-6) in one byte, block scale 2, global scale 0.25
    weight = torch.full((1, 8), 0xF1, dtype=torch.uint8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = dequantize_nvfp4(weight, scale, torch.tensor(0.25))
    assert out[0, :2].tolist() == [0.25, -3.0] and out.shape == (1, 16)


def test_qdq_matches_weight_path_when_scales_agree():
    # with global scale amax/2688 the activation path picks the same block scales as the weight export
    # (the two differ only in rounding order: (1/gs)*amax/6 vs amax/(6*gs), which can move an fp8 block
    # scale by one step at a rare tie), so nearly every element agrees exactly
    x = torch.randn(6, 64)
    gs = nvfp4_global_scale(x.abs().max())
    via_weight, via_act = dequantize_nvfp4(*quantize_nvfp4(x, gs)), nvfp4_qdq(x, gs)
    assert (via_weight == via_act).float().mean() > 0.99
    assert_close("qdq vs weight path", via_weight, via_act, 1e-2)
    err = rel_rms_error(x, nvfp4_qdq(x, gs))
    assert 0.07 < err < 0.12


def test_qdq_edge_cases():
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    y = nvfp4_qdq(x, nvfp4_global_scale(x.float().abs().max()))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # a zero block and a block whose fp8 scale underflows to 0 both give 0, not NaN
    x = torch.randn(1, 48)
    x[0, :16] = 0.0
    x[0, 16:32] = 1e-12
    y = nvfp4_qdq(x, nvfp4_global_scale(x.abs().max()))
    assert torch.isfinite(y).all() and torch.all(y[0, :32] == 0)
    # a global scale too small for this data: block scales clamp at 448 and values at +-6*448*gs
    gs = torch.tensor(1e-4)
    y = nvfp4_qdq(torch.full((1, 16), 10.0), gs)
    assert torch.allclose(y, torch.full((1, 16), 6 * 448 * 1e-4))


def test_bad_inputs():
    with pytest.raises(ValueError, match="K \\(last dim\\) must be a multiple of 16, got 40"):
        quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="finite"):
        quantize_nvfp4(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_nvfp4(torch.randn(16))
    with pytest.raises(ValueError, match="expected dtype.*got torch.int32"):
        quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight_scale_2: expected positive finite"):
        quantize_nvfp4(torch.randn(2, 16), torch.tensor(0.0))
    with pytest.raises(
        ValueError, match=r"weight_scale_2: expected a scalar or shape \(3,\), got shape \(2,\)"
    ):
        quantize_nvfp4(torch.randn(3, 2, 16), torch.ones(2))
    t = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="weight_scale: expected shape \\(4, 2\\), got \\(4, 3\\)"):
        dequantize_nvfp4(t.weight, torch.ones(4, 3).to(torch.float8_e4m3fn), t.weight_scale_2)
    with pytest.raises(ValueError, match="weight_scale: expected dtype .*e4m3fn, got torch.float32"):
        dequantize_nvfp4(t.weight, t.weight_scale.float(), t.weight_scale_2)
    with pytest.raises(ValueError, match="packed width K/2 must be a multiple of 8, got 7"):
        dequantize_nvfp4(t.weight[:, :7], t.weight_scale, t.weight_scale_2)
    with pytest.raises(ValueError, match="weight: expected dtype torch.uint8, got torch.int8"):
        dequantize_nvfp4(t.weight.to(torch.int8), t.weight_scale, t.weight_scale_2)
    with pytest.raises(ValueError, match="global_scale: expected positive finite"):
        nvfp4_qdq(torch.randn(2, 16), float("inf"))
    with pytest.raises(ValueError, match="K \\(last dim\\) must be a multiple of 16, got 8"):
        nvfp4_qdq(torch.randn(2, 8), 1.0)
    with pytest.raises(ValueError, match="amax: expected finite values >= 0"):
        nvfp4_global_scale(-1.0)
    assert NVFP4_GROUP == 16
