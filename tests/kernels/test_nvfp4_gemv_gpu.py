"""The Gluon NVFP4 decode kernel (kernels/nvfp4_gemm/gluon_gemv.py) on a GPU against the fp32 reference.

Its PTX decoder is checked on the CPU by an emulator (test_nvfp4_gemm.py); everything else needs sm_80+.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, nvfp4_linear_ref, prepare_nvfp4_weight
from k3run.testing import assert_close
from tests.kernels.test_nvfp4_gemm import BF16_RTOL, FP16_RTOL, _random_nvfp4

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 45])
@pytest.mark.parametrize(
    "num_warps, block_k, split_k, depth",
    [(1, 256, 1, 1), (1, 512, 3, 2), (2, 256, 4, 3), (4, 128, 2, 2), (1, 128, 8, 3), (1, 128, 5, 2)],
)
def test_gemv_odd_shapes_bf16(poison_empty, m: int, num_warps: int, block_k: int, split_k: int, depth: int):
    """N = 520 (not a multiple of 16 * num_warps), K = 3600 (pads to 3712: a partial last chunk), bias,
    per-row global scales, token tiles 8 / 16 / 32 and M = 45 in two launches (32 + 13): bf16 output rounding
    bounds the relative RMS error (BF16_RTOL)."""
    n, k = 520, 3600
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    cfg = GemmConfig(gemv=True, num_warps=num_warps, block_k=block_k, split_k=split_k, depth=depth)
    ref = nvfp4_linear_ref(x.float(), w, s, gs, bias.float())
    y = nvfp4_linear(x, pw, bias, config=cfg)
    assert_close(f"gemv m={m} {cfg}", ref, y, rtol=BF16_RTOL)
    # the split-K arrival counters are reset by every launch: a second call gives the same bits
    assert torch.equal(y, nvfp4_linear(x, pw, bias, config=cfg))


@pytest.mark.parametrize("m, split_k, depth", [(1, 1, 2), (5, 4, 3), (16, 7, 1)])
def test_gemv_fp16_exact_k(poison_empty, m: int, split_k: int, depth: int):
    """fp16, K a multiple of 128 (the unmasked x path), per-tensor global scale, no bias."""
    n, k = 4096 + 48, 7168
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs)
    x = torch.randn(m, k, device="cuda").half()
    y = nvfp4_linear(x, pw, config=GemmConfig(gemv=True, block_k=128, split_k=split_k, depth=depth))
    assert_close(f"gemv fp16 m={m}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=FP16_RTOL)


def test_gemv_strided_input_and_negative_zero(poison_empty):
    """x as a row-strided view; weights containing -0 codes and subnormal (2^-9) group scales."""
    n, k = 96, 640
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    w[:, ::7] = 0x88  # -0 in both nibbles
    s.view(torch.uint8)[:, ::5] = 0x01  # E4M3 subnormal 2^-9
    pw = prepare_nvfp4_weight(w, s, gs)
    big = torch.randn(4, 2 * k, device="cuda").bfloat16()
    x = big[:, :k]
    y = nvfp4_linear(x, pw, config=GemmConfig(gemv=True, split_k=2))
    assert_close("gemv strided", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=BF16_RTOL)
