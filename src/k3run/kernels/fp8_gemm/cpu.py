"""FP8_PB_WO linear on the CPU, compiled (kernels/cpu_fused.py: when it applies, the fallback).

The activations are quantized per token and 128 columns exactly as the reference does (they are small);
the weight is decoded inside the dot products for decode-sized M (<= cpu_fused.MAX_M), by the AVX-512 /
AVX2 extension of kernels/cpu_simd.py where the CPU has one, else by this compiled loop:

    y[m, n] = sum_kb s_x[m, kb] * s_w[n // 128, kb] * sum_{j < 128} q_x[m, 128 kb + j] * q_w[n, 128 kb + j]

with E4M3 bytes turned into fp32 by integer operations (sign, exponent and mantissa fields; the subnormal
codes by one multiply), which Inductor vectorises, and no [N, K] temporary. The products of two E4M3 values
are exact in fp32; the result differs from the reference (dequantize both, then an fp32 matmul) only in
where the scales are applied and in summation order. Larger M dequantizes the weight in row blocks of ~8 MB
(a compiled one-pass dequantization) and multiplies block by block. Only the n_logical real rows are
computed (the padding rows are zeros). Measured: bench/bench_cpu_gemv.py, bench/RESULTS.md.
"""

from __future__ import annotations

import torch

from k3run.formats import dequantize_fp8_act_1x128, quantize_fp8_act_1x128
from k3run.formats.fp8_block import e4m3_to_float
from k3run.kernels import cpu_fused, cpu_simd

from .ref import fp8_pb_wo_linear_ref


def _e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bytes as int32 0..255 -> fp32, exactly (NaN codes, never in a checkpoint, aside)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).view(torch.float32)
    value = torch.where(e == 0, m.to(torch.float32) * 2.0**-9, normal)
    return torch.where((bits & 128) != 0, -value, value)


def fp8_block_gemv_fused(
    q_x: torch.Tensor, scale_x: torch.Tensor, q_w: torch.Tensor, scale_w: torch.Tensor
) -> torch.Tensor:
    """y [M, N] fp32 from the activation codes as fp32 values q_x [M, K], their scales [M, K/128], the
    weight float8_e4m3fn [N, K] and its tile scales [>= N/128, K/128]. Eager torch materialises [M, N, K]
    temporaries; `fp8_pb_wo_linear_cpu` runs it compiled."""
    n = q_w.shape[0]
    w = _e4m3_to_float(q_w.view(torch.uint8).to(torch.int32))
    dots = (q_x.view(q_x.shape[0], 1, -1, 128) * w.view(1, n, -1, 128)).sum(-1)  # [M, N, K/128]
    rows = scale_w.repeat_interleave(128, dim=0)[:n]  # [N, K/128]
    return (dots * scale_x.view(scale_x.shape[0], 1, -1) * rows[None]).sum(-1)


def fp8_dequantize_fused(q_w: torch.Tensor, scale_w: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] (E4M3 value times its tile scale), one pass over the bytes when compiled."""
    n = q_w.shape[0]
    w = _e4m3_to_float(q_w.view(torch.uint8).to(torch.int32)).view(n, -1, 128)
    return (w * scale_w.repeat_interleave(128, dim=0)[:n, :, None]).view(n, -1)


def fp8_pb_wo_linear_cpu(
    x: torch.Tensor,
    weight_padded: torch.Tensor,
    scale_2d: torch.Tensor,
    n_logical: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_pb_wo_linear_ref's contract (x [M, K], weight fp8 [N_pad, K], tile scales fp32 [N_pad/128, K/128],
    the real N, bias), compiled on large matrices, else the reference."""
    m, k = x.shape

    def reference() -> torch.Tensor:
        return fp8_pb_wo_linear_ref(x, weight_padded, scale_2d, n_logical, bias)

    if not cpu_fused.applies(n_logical, k):
        return reference()
    q_x, scale_x = quantize_fp8_act_1x128(x)
    weight = weight_padded[:n_logical]
    if m <= cpu_simd.FP8_MAX_M and k % 128 == 0 and cpu_simd.available():  # x86 with AVX-512 / AVX2
        y = cpu_simd.fp8_block_gemv_simd(e4m3_to_float(q_x), scale_x, weight, scale_2d)
    elif m <= cpu_fused.MAX_M:
        y = cpu_fused.run(fp8_block_gemv_fused, e4m3_to_float(q_x), scale_x, weight, scale_2d)
    else:
        xf = dequantize_fp8_act_1x128(q_x, scale_x)
        y = cpu_fused.dequantized_matmul(
            xf, n_logical, cpu_fused.block_rows(k, 128), fp8_dequantize_fused,
            lambda i, j: (weight[i:j], scale_2d[i // 128 : j // 128]),
        )  # fmt: skip
    if y is None:  # the compile failed: the reference, now and from then on
        return reference()
    return cpu_fused.finish(y, bias, x.dtype)
