from __future__ import annotations

import pytest
import torch

from k3run.formats import (
    FP8_BLOCK,
    dequantize_fp8_act_1x128,
    dequantize_fp8_block,
    quantize_fp8_act_1x128,
    quantize_fp8_block,
)
from k3run.testing import rel_rms_error

# E4M3 keeps 3 mantissa bits: one round-to-nearest is <= 2^-4 relative for normals; on Gaussian data
# the relative RMS is ~0.027 (values far below the tile amax fall into subnormals and lose a little more)
FP8_REL_RMS = 0.035


@pytest.mark.parametrize(("n", "k"), [(128, 128), (200, 130), (64, 96), (300, 384)])
def test_block_shapes_scales_and_round_trip(n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16)
    q, s = quantize_fp8_block(w)
    nb, kb = -(-n // 128), -(-k // 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.float32 and s.shape == (nb, 1, kb, 1)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert s[i, 0, j, 0].item() == (tile.abs().max() / 448.0).item()
            # each tile's amax element maps to +-448 exactly
            assert q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max().item() == 448.0
    w_hat = dequantize_fp8_block(q, s)
    assert w_hat.shape == (n, k) and w_hat.dtype == torch.float32
    assert rel_rms_error(w.float(), w_hat) < FP8_REL_RMS
    # the 2-D [Nb, Kb] layout gives the same values
    assert torch.equal(dequantize_fp8_block(q, s.reshape(nb, kb)), w_hat)


def test_q_is_rounded_w_over_scale():
    w = torch.randn(130, 140)
    q, s = quantize_fp8_block(w)
    full = s.reshape(2, 2).repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :140]
    x = w / full
    # nearest e4m3: the error is at most half a step, a step being 2^(floor(log2|x|) - 3), min 2^-9
    step = torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=2.0**-6))) - 3)
    assert torch.all((q.float() - x).abs() <= step / 2)


def test_edge_tile_ignores_padding_and_zero_tile_scale_is_one():
    w = torch.randn(200, 130)
    w[128:, :128] = 0.0  # the whole (1, 0) tile
    w[:128, 128:] *= 1e-3  # a partial-K tile with small values gets its own small scale
    q, s = quantize_fp8_block(w)
    assert s[1, 0, 0, 0].item() == 1.0
    assert torch.all(q[128:, :128].float() == 0)
    assert s[0, 0, 1, 0].item() == (w[:128, 128:].abs().max() / 448).item()
    assert rel_rms_error(w[:128, 128:], dequantize_fp8_block(q, s)[:128, 128:]) < FP8_REL_RMS


def test_single_tile_scalar_scale_and_explicit_scale():
    w = torch.randn(64, 32)
    q, s = quantize_fp8_block(w)
    assert s.shape == (1, 1, 1, 1)
    # ModelOpt writes a single tile's scale as a 0-dim tensor
    assert torch.equal(dequantize_fp8_block(q, s.reshape(())), dequantize_fp8_block(q, s))
    # a shared (larger) scale, as ModelOpt gives fused single-tile layers
    shared = s.reshape(()) * 2
    q2, s2 = quantize_fp8_block(w, shared)
    assert s2.shape == (1, 1, 1, 1) and s2.item() == shared.item()
    assert torch.equal(q2, (w / shared).to(torch.float8_e4m3fn))
    assert rel_rms_error(w, dequantize_fp8_block(q2, s2)) < FP8_REL_RMS


def test_act_1x128():
    x = torch.randn(5, 384, dtype=torch.bfloat16) * torch.tensor([1.0, 100.0, 1e-3]).repeat_interleave(128)
    x[2, 128:256] = 0.0
    q, s = quantize_fp8_act_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 384)
    assert s.dtype == torch.float32 and s.shape == (5, 3)
    groups = x.float().reshape(5, 3, 128)
    assert torch.equal(s, groups.abs().amax(-1).clamp(min=1e-10) / 448)
    assert s[2, 1].item() == pytest.approx(1e-10 / 448)
    x_hat = dequantize_fp8_act_1x128(q, s)
    assert torch.all(x_hat[2, 128:256] == 0)
    for g in range(3):  # each 1x128 group has its own scale, so every column block is accurate
        assert (
            rel_rms_error(x[:, g * 128 : (g + 1) * 128].float(), x_hat[:, g * 128 : (g + 1) * 128])
            < FP8_REL_RMS
        )
    # leading batch dims are flattened consistently
    q3, s3 = quantize_fp8_act_1x128(x.reshape(5, 1, 384))
    assert torch.equal(s3.reshape(5, 3), s)
    assert dequantize_fp8_act_1x128(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_bad_inputs():
    with pytest.raises(ValueError, match="expected 2 dims \\[N, K\\], got shape \\(2, 3, 4\\)"):
        quantize_fp8_block(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="finite"):
        quantize_fp8_block(torch.tensor([[1.0, float("inf")]]))
    q, s = quantize_fp8_block(torch.randn(200, 300))
    with pytest.raises(ValueError, match="expected shape \\(2, 1, 3, 1\\), got \\(2, 1, 2, 1\\)"):
        dequantize_fp8_block(q, torch.ones(2, 1, 2, 1))
    with pytest.raises(ValueError, match="a 0-dim scale needs a single tile, got 2x3 tiles"):
        dequantize_fp8_block(q, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale: expected dtype torch.float32, got torch.bfloat16"):
        dequantize_fp8_block(q, s.bfloat16())
    with pytest.raises(ValueError, match="q: expected dtype torch.float8_e4m3fn, got torch.float32"):
        dequantize_fp8_block(q.float(), s)
    with pytest.raises(ValueError, match="scale: expected positive finite"):
        quantize_fp8_block(torch.randn(4, 4), torch.tensor(0.0))
    with pytest.raises(ValueError, match="K \\(last dim\\) must be a multiple of 128, got 100"):
        quantize_fp8_act_1x128(torch.randn(2, 100))
    with pytest.raises(ValueError, match="finite"):
        quantize_fp8_act_1x128(torch.full((1, 128), float("nan")))
    qa, sa = quantize_fp8_act_1x128(torch.randn(2, 256))
    with pytest.raises(ValueError, match="scale: expected shape \\(2, 2\\), got \\(2, 1\\)"):
        dequantize_fp8_act_1x128(qa, sa[:, :1])
    assert FP8_BLOCK == 128


@pytest.mark.parametrize("n, k", [(256, 384), (200, 300), (128, 128)])
def test_dequantize_tile_broadcast_equals_the_expanded_scale(n: int, k: int) -> None:
    """Whole tiles take the broadcast path, partial ones the expanded scale: both give q * s bit for bit."""
    q, s = quantize_fp8_block(torch.randn(n, k) * 5)
    s2 = s.reshape(s.shape[0], s.shape[2])
    full = s2.repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)[:, :k]
    want = q.float() * full
    assert torch.equal(dequantize_fp8_block(q, s), want)
    assert torch.equal(dequantize_fp8_block(q, s, torch.bfloat16), want.to(torch.bfloat16))


def test_e4m3_table_cast_is_the_plain_cast_for_every_byte() -> None:
    from k3run.formats.fp8_block import e4m3_to_float

    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16).t()  # strided too
    got, want = e4m3_to_float(q), q.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)) and got.shape == want.shape
