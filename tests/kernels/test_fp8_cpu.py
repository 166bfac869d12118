"""The compiled CPU FP8_PB_WO linear (kernels/fp8_gemm/cpu.py) against the fp32 reference.

Error bound: the activation codes and scales are the reference's own (the same quantizer); the products of
two E4M3 values are exact in fp32. The fused GEMV applies the two scales after each 128-wide dot where the
reference applies them to every element first, and sums in another order: relative RMS ~sqrt(K) * 2^-24,
bound 1e-5 for fp32 outputs; bf16 outputs round the same fp32 value, one bf16 ulp apart at ties (4e-3).
"""

from __future__ import annotations

import pytest
import torch

import k3run.kernels.cpu_simd as cpu_simd
import k3run.kernels.fp8_gemm.cpu as cpu
from k3run.formats import quantize_fp8_act_1x128
from k3run.kernels import cpu_fused
from k3run.kernels.fp8_gemm import fp8_pb_wo_linear
from k3run.kernels.fp8_gemm.ref import fp8_block_gemm_ref, fp8_pb_wo_linear_ref
from k3run.testing import RTOL, assert_close
from tests.kernels.cpu_paths import needs_cxx, needs_simd
from tests.kernels.test_fp8_gemm import _padded_block_weight


def test_e4m3_bytes_decode_exactly() -> None:
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.int32)  # all but NaN
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(cpu._e4m3_to_float(codes), want)


def test_eager_formula_matches_reference() -> None:
    w_pad, s_w = _padded_block_weight(200, 384)
    q_x, s_x = quantize_fp8_act_1x128(torch.randn(3, 384))
    want = fp8_block_gemm_ref(q_x, s_x, w_pad, s_w)[:, :200]
    got = cpu.fp8_block_gemv_fused(q_x.float(), s_x, w_pad[:200], s_w)
    assert_close("fp8 fused formula", want, got, rtol=RTOL[torch.float32])


@needs_simd
@pytest.mark.parametrize("m", [1, 3, 8, 21])
def test_simd_linear_matches_reference(monkeypatch, simd_level, m: int) -> None:
    """The SIMD extension (AVX-512 and AVX2) through fp8_pb_wo_linear on the CPU: N = 300 real rows of 384
    (the padding never computed; the last tile scale row shared by 44 rows), K = 640 (5 blocks), bias, fp32
    and bf16; 21 rows in several kernel calls."""
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 0)
    assert cpu_simd.available(), cpu_simd._error
    n, k = 300, 640
    w_pad, s_w = _padded_block_weight(n, k)
    bias = torch.randn(n)
    for dtype, rtol in ((torch.float32, RTOL[torch.float32]), (torch.bfloat16, 4e-3)):
        x = torch.randn(m, k).to(dtype)
        want = fp8_pb_wo_linear_ref(x, w_pad, s_w, n, bias)
        got = fp8_pb_wo_linear(x, w_pad, s_w, n, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_close(f"{simd_level} fp8 m={m} {dtype}", want, got, rtol=rtol)


@needs_simd
def test_simd_every_e4m3_code_exact(simd_level) -> None:
    """Every E4M3 weight byte but NaN (subnormals and -0 included) read back through one-hot activations
    with unit scales: exact."""
    assert cpu_simd.available(), cpu_simd._error
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254
    n, k = codes.numel(), 128
    w = codes.reshape(n, 1).expand(n, k).contiguous()
    s_w = torch.ones(-(-n // 128), 1)
    q_x = torch.zeros(2, k)
    q_x[0, 5] = 1.0
    q_x[1, 127] = -2.0
    got = cpu_simd.fp8_block_gemv_simd(q_x, torch.ones(2, 1), w, s_w)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[0], want) and torch.equal(got[1], -2.0 * want)
    with pytest.raises(ValueError, match="multiple of 128"):
        cpu_simd.fp8_block_gemv_simd(torch.zeros(1, 96), torch.ones(1, 1), w[:, :96], s_w)


@needs_cxx
@pytest.mark.parametrize("m", [1, 5, 12])
def test_compiled_linear_matches_reference(fused_everywhere, monkeypatch, m: int) -> None:
    """Through fp8_pb_wo_linear on the CPU: N = 300 real rows of 384 (padding never computed), bias,
    leading dims, fp32 and bf16; M = 12 takes the dequantize-in-row-blocks path (3 blocks of 128 rows)."""
    monkeypatch.setattr(cpu_fused, "DEQUANT_BLOCK_FLOATS", 128 * 256)
    n, k = 300, 256
    w_pad, s_w = _padded_block_weight(n, k)
    bias = torch.randn(n)
    for dtype, rtol in ((torch.float32, RTOL[torch.float32]), (torch.bfloat16, 4e-3)):
        x = torch.randn(m, k).to(dtype)
        want = fp8_pb_wo_linear_ref(x, w_pad, s_w, n, bias)
        got = fp8_pb_wo_linear(x.reshape(1, m, k), w_pad, s_w, n, bias)
        assert got.shape == (1, m, n) and got.dtype == dtype
        assert_close(f"fp8 cpu m={m} {dtype}", want.float(), got[0].float(), rtol=rtol)
    assert cpu_fused.disabled is None, cpu_fused.disabled


def test_small_matrices_keep_the_reference() -> None:
    w_pad, s_w = _padded_block_weight(100, 128)
    x = torch.randn(2, 128)
    assert not cpu_fused.applies(100, 128)
    assert torch.equal(cpu.fp8_pb_wo_linear_cpu(x, w_pad, s_w, 100), fp8_pb_wo_linear_ref(x, w_pad, s_w, 100))
