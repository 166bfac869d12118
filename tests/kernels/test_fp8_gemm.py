"""FP8_PB_WO linear: block-wise _scaled_mm and the Triton block-FP8 GEMM against the fp32 reference.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules.
"""

from __future__ import annotations

import pytest
import torch

from k3run.formats import dequantize_fp8_block, quantize_fp8_act_1x128, quantize_fp8_block
from k3run.kernels.fp8_gemm import (
    default_backend,
    fp8_block_gemm_ref,
    fp8_pb_wo_linear,
    fp8_pb_wo_linear_ref,
    scaled_mm_shape_ok,
)
from k3run.testing import RTOL, assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32 output: E4M3 x E4M3 products are exact in fp32 (8 significant bits), so only the fp32 summation order
# differs (~K * 2^-24 relative at worst for K <= 512).
# bf16 output: one final rounding <= 2^-9 relative; Hopper's FP8 MMA accumulates each 128-wide group in
# reduced precision (~2^-14 relative) before the fp32 scaling, far below that. Bound 2^-8.


def _padded_block_weight(n: int, k: int, device: str = "cpu"):
    """Checkpoint-like FP8_PB_WO weight of n rows, zero-padded to 128 rows as the scheme does; the tile
    magnitudes spread over 2^-4..2^4 so a transposed or misindexed scale shows up."""
    w = torch.randn(n, k, device=device)
    w *= 2.0 ** torch.randint(-4, 5, (-(-n // 128), 1, k // 128, 1), device=device).float().repeat_interleave(
        128, 0
    ).reshape(-1, k // 128)[:n].repeat_interleave(128, 1)
    q, scale = quantize_fp8_block(w)
    n_pad = scale.shape[0] * 128
    q_pad = torch.zeros(n_pad, k, dtype=torch.float8_e4m3fn, device=device)
    q_pad[:n] = q
    return q_pad, scale.reshape(scale.shape[0], scale.shape[2]).contiguous()


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=3)


@interp_only
def test_interp_block_gemm_fp32_crop_bias(poison_empty):
    from k3run.kernels.fp8_gemm.triton import fp8_block_gemm

    m, n, k = 5, 200, 256  # n padded to 256 rows; the last 128-row weight block is partial
    w_pad, s_w = _padded_block_weight(n, k)
    q_x, s_x = quantize_fp8_act_1x128(torch.randn(m, k) * 3)
    bias = torch.randn(n)
    y = fp8_block_gemm(q_x, s_x, w_pad, s_w, n, torch.float32, bias, block_m=16, block_n=64, group_m=2)
    ref = fp8_block_gemm_ref(q_x, s_x, w_pad, s_w)[:, :n] + bias
    assert_close("fp8_block_gemm", ref, y, rtol=RTOL[torch.float32])


@interp_only
def test_interp_linear_triton_backend(poison_empty):
    m, n, k = 3, 130, 384
    w_pad, s_w = _padded_block_weight(n, k)
    x = torch.randn(m, k)
    y = fp8_pb_wo_linear(x, w_pad, s_w, n, backend="triton")
    assert_close("fp8_pb_wo triton", fp8_pb_wo_linear_ref(x, w_pad, s_w, n), y, rtol=RTOL[torch.float32])


@interp_only
def test_interp_decode_gemv_fused_quant(poison_empty):
    """The decode GEMV (quantization fused, split-K, crop, bias) at M = 1 / 5 / 16, odd N (pad rows), three
    K groups split 1 and 3 ways, block_n 32 and 64: fp32 output, so only the summation order differs from
    the reference (the in-kernel quantization is the reference's, bit for bit)."""
    from k3run.kernels.fp8_gemm.gemv import fp8_gemv

    n, k = 130, 384
    w_pad, s_w = _padded_block_weight(n, k)
    bias = torch.randn(n)
    for m, split, bn, pre in ((1, 3, 64, False), (5, 1, 32, True), (16, 3, 128, False)):
        x = torch.randn(m, k) * 3
        y = fp8_gemv(x, w_pad, s_w, n, bias, block_n=bn, split_k=split, prequant=pre)
        ref = fp8_pb_wo_linear_ref(x, w_pad, s_w, n, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_close(f"fp8_gemv m={m} split={split} bn={bn} prequant={pre}", ref, y, rtol=RTOL[torch.float32])


def test_ref_identity_input_returns_dequantized_weight():
    """x = I is exact through 1x128 quantization (scale 1/448, q = 448), so y = W^T exactly: the property
    MLA weight absorption relies on."""
    n, k = 200, 256
    w_pad, s_w = _padded_block_weight(n, k)
    y = fp8_pb_wo_linear(torch.eye(k), w_pad, s_w, n)
    assert y.shape == (k, n)
    assert torch.equal(y, dequantize_fp8_block(w_pad, s_w)[:n].t())


def test_ref_crop_bias_and_leading_dims():
    n, k = 130, 256
    w_pad, s_w = _padded_block_weight(n, k)
    x = torch.randn(2, 3, k)
    bias = torch.randn(n)
    y = fp8_pb_wo_linear(x, w_pad, s_w, n, bias)
    assert y.shape == (2, 3, n) and y.is_contiguous()
    q_x, s_x = quantize_fp8_act_1x128(x.reshape(6, k))
    ref = fp8_block_gemm_ref(q_x, s_x, w_pad, s_w)[:, :n] + bias
    assert_close("fp8_pb_wo ref", ref.reshape(2, 3, n), y, rtol=1e-6)


def test_contract_errors():
    w_pad, s_w = _padded_block_weight(130, 384)
    with pytest.raises(ValueError, match="divisible by 128"):
        fp8_pb_wo_linear(torch.randn(2, 200), w_pad[:, :200], s_w, 130)
    with pytest.raises(ValueError, match="rounded up to 128"):
        fp8_pb_wo_linear(torch.randn(2, 384), w_pad, s_w, 100)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_pb_wo_linear(torch.randn(2, 384), w_pad, s_w.t(), 130)
    with pytest.raises(ValueError, match="bias"):
        fp8_pb_wo_linear(torch.randn(2, 384), w_pad, s_w, 130, torch.randn(256))
    with pytest.raises(ValueError, match="backend"):
        fp8_pb_wo_linear(torch.randn(2, 384), w_pad, s_w, 130, backend="cutlass")
    with pytest.raises(ValueError, match="multiple of 512"):
        fp8_pb_wo_linear(torch.randn(2, 384), w_pad, s_w, 130, backend="scaled_mm")


def test_backend_choice():
    assert default_backend(torch.device("cpu"), 7168) == "ref"
    assert scaled_mm_shape_ok(7168) and scaled_mm_shape_ok(512) and not scaled_mm_shape_ok(640)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("n", [300, 320, 384])  # crop, unpadded view, no padding
def test_gpu_backends(poison_empty, backend: str, m: int, n: int):
    from k3run.kernels.fp8_gemm import blockwise_scaled_mm_supported

    if backend == "scaled_mm" and not blockwise_scaled_mm_supported(torch.device("cuda")):
        pytest.skip("block-wise torch._scaled_mm needs sm90 and CUDA >= 12.9")
    k = 7168 if backend == "scaled_mm" else 640  # scaled_mm: K/128 must be a multiple of 4 (measured)
    w_pad, s_w = _padded_block_weight(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    for b in (None, bias):
        y = fp8_pb_wo_linear(x, w_pad, s_w, n, b, backend=backend)
        assert y.shape == (m, n) and y.is_contiguous() and y.dtype == torch.bfloat16
        ref = fp8_pb_wo_linear_ref(x.float().cpu(), w_pad.cpu(), s_w.cpu(), n, None if b is None else b.cpu())
        assert_close(f"fp8_pb_wo {backend} m={m} n={n}", ref, y, rtol=RTOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(300, 640), (2112, 7168), (333, 512)])
def test_gpu_decode_gemv(poison_empty, m: int, n: int, k: int):
    """The decode GEMV against the fp32 reference on odd shapes (crop, pad rows, K / 128 = 5 / 56 / 4), bf16
    in and out, with and without bias (bound: one bf16 output rounding, RTOL[torch.bfloat16]), and in fp32
    (only the summation order: RTOL[torch.float32]); fp8_pb_wo_linear takes it for these M on CUDA."""
    from k3run.kernels.fp8_gemm.gemv import fp8_gemv

    w_pad, s_w = _padded_block_weight(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda") * 2
    bias = torch.randn(n, device="cuda")
    for b in (None, bias):
        ref = fp8_pb_wo_linear_ref(x.cpu(), w_pad.cpu(), s_w.cpu(), n, None if b is None else b.cpu())
        assert_close(
            f"fp8_gemv fp32 m={m} n={n}", ref, fp8_gemv(x, w_pad, s_w, n, b), rtol=RTOL[torch.float32]
        )
        xb, bb = x.bfloat16(), None if b is None else b.bfloat16()
        refb = fp8_pb_wo_linear_ref(
            xb.float().cpu(), w_pad.cpu(), s_w.cpu(), n, None if b is None else bb.cpu()
        )
        y = fp8_pb_wo_linear(xb, w_pad, s_w, n, bb)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
        assert_close(f"fp8_pb_wo decode m={m} n={n}", refb, y, rtol=RTOL[torch.bfloat16])
        for bn, split, pre in ((32, 1, False), (128, k // 128, False), (64, 1, True)):
            got = fp8_gemv(xb, w_pad, s_w, n, bb, block_n=bn, split_k=split, prequant=pre)
            assert_close(
                f"fp8_gemv bn={bn} split={split} prequant={pre}", refb, got, rtol=RTOL[torch.bfloat16]
            )


@pytest.mark.gpu
def test_gpu_decode_gemv_in_a_graph():
    """Captured in a CUDA graph and replayed with new inputs: the same as eager calls (no host sync)."""
    from k3run.kernels.fp8_gemm.gemv import fp8_gemv

    n, k = 520, 1024
    w_pad, s_w = _padded_block_weight(n, k, device="cuda")
    x = torch.randn(4, k, device="cuda").bfloat16()
    fp8_gemv(x, w_pad, s_w, n)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, w_pad, s_w, n)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_gemv(x, w_pad, s_w, n))


@pytest.mark.gpu
def test_gpu_scaled_mm_identity_exact():
    """x = I through block-wise _scaled_mm gives W^T up to the bf16 output rounding (a scale layout check: a
    wrong scale layout is off by O(1)). fp8 * fp32 scale is not a bf16 value in general, so each output
    element carries one bf16 rounding (<= 2^-9 relative; ~1.5e-3 RMS measured on an H200): bound 2^-9."""
    from k3run.kernels.fp8_gemm import blockwise_scaled_mm_supported

    if not blockwise_scaled_mm_supported(torch.device("cuda")):
        pytest.skip("block-wise torch._scaled_mm needs sm90 and CUDA >= 12.9")
    n, k = 256, 512
    w_pad, s_w = _padded_block_weight(n, k, device="cuda")
    y = fp8_pb_wo_linear(torch.eye(k, device="cuda").bfloat16(), w_pad, s_w, n, backend="scaled_mm")
    ref = dequantize_fp8_block(w_pad, s_w)[:n].t()
    assert_close("identity through _scaled_mm", ref, y, rtol=2.0**-9)
