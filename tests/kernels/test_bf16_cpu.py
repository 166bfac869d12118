"""The CPU bf16 decode GEMV (cpu_simd.bf16_gemv) against the fp32 matmul of the same bf16 weights.

Bound: bf16 -> fp32 is exact, so both sum the same exact fp32 products over K in different orders: the
relative RMS difference is a few K-term fp32 roundings, ~sqrt(K) 2^-24; bound 4 K 2^-24 (K <= 2304 here).
Through an unquantized linear in bf16 the output is rounded to bf16 once, as torch's bf16 matmul rounds its
fp32 accumulator: within one bf16 ulp (2^-8 relative) of it.
"""

from __future__ import annotations

import pytest
import torch

import k3run.kernels.cpu_simd as cpu_simd
from k3run.knobs import reset_knobs
from k3run.testing import assert_close


@pytest.fixture
def avx512(monkeypatch):
    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    if cpu_simd.cpu_level() != "avx512" or not cpu_simd.available():
        pytest.skip("needs AVX-512 and the SIMD extension")


@pytest.mark.parametrize("m, n, k", [(1, 37, 48), (3, 300, 1000), (8, 65, 2304), (5, 1031, 17)])
def test_bf16_gemv_matches_fp32_matmul(avx512, m, n, k) -> None:
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(m, k)
    assert_close("bf16 gemv", x @ w.float().t(), cpu_simd.bf16_gemv(x, w), 4 * k * 2.0**-24)


def test_linear_takes_it_for_large_bf16_decode_rows(avx512, monkeypatch) -> None:
    from k3run.quant.schemes import UnquantizedScheme

    class Layer(torch.nn.Module):
        prefix = "head"

    layer = Layer()
    layer.weight = torch.nn.Parameter(torch.randn(1100, 1024).bfloat16(), requires_grad=False)
    layer.weights = None
    scheme = UnquantizedScheme()
    monkeypatch.setattr("k3run.quant.schemes._check_input", lambda layer, x: None)
    x = torch.randn(2, 1024).bfloat16()
    bias = torch.randn(1100).bfloat16()
    assert cpu_simd.bf16_gemv_applies(x, layer.weight)
    got = scheme.apply(layer, x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1100)
    assert_close(
        "linear via bf16_gemv", torch.nn.functional.linear(x, layer.weight, bias).float(), got.float(), 2**-8
    )
    assert not cpu_simd.bf16_gemv_applies(torch.randn(9, 1024).bfloat16(), layer.weight)  # > BF16_MAX_M
    assert not cpu_simd.bf16_gemv_applies(x, layer.weight[:500])  # under BF16_MIN_WEIGHTS
