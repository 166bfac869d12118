"""NVFP4 W4A16 linear on the CPU, compiled (kernels/cpu_fused.py: when it applies, the fallback).

On x86 CPUs with AVX-512 or AVX2, up to cpu_simd.NVFP4_MAX_M rows: the C++ extension of cpu_simd.py (codes
decoded by register permutes; at 7168 x 7168 and one token ~9x this loop with AVX-512 and ~4.6x with AVX2,
bench/RESULTS.md); and for bf16 inputs above cpu_fused.MAX_M rows (prefill in a bf16 model), the extension
decodes the weight exactly to bf16 in row blocks for a bf16 matmul (`_bf16_prefill`: 3.4-11x the fp32 path at
16-256 rows, bench/RESULTS.md, outputs within one bf16 ulp of the reference). Elsewhere, decode-sized M
(<= cpu_fused.MAX_M): the weights are decoded inside the dot products, one compiled loop that reads each
packed byte once and never materialises the weight:

    y[m, n] = 0.25 * gs[n] * sum_g s[n, g] * sum_{j < 8} (c_lo(w[n, 8g + j]) x[m, 16g + 2j]
                                                       + c_hi(w[n, 8g + j]) x[m, 16g + 2j + 1])

where c = 4 * e2m1(code) is built by integer operations (sign, exponent and mantissa bits of the 4-bit code;
no table lookups, which Inductor would turn into scalar gathers with bounds checks), and x's even and odd
columns are split once per call so every load is contiguous. fp32 throughout; it differs from the reference
(`ref.py`) only in summation order. Larger M (prefill) decodes the weight once, in row blocks of ~8 MB
(reused memory: a whole-matrix fp32 temporary costs more in page faults than in decoding), with a compiled
one-pass dequantization, and multiplies block by block. Measured: bench/bench_cpu_gemv.py, bench/RESULTS.md.
"""

from __future__ import annotations

import torch

from k3run.kernels import cpu_fused, cpu_simd

from .ref import nvfp4_linear_ref


def _e2m1_times4(code: torch.Tensor) -> torch.Tensor:
    """4 * e2m1(code) for int32 codes 0..15, exactly, as fp32: magnitudes 0, 2, 4, 6, 8, 12, 16, 24."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    value = torch.where(e == 0, m * 2, (m + 2) << e)
    return torch.where((code & 8) != 0, -value, value).to(torch.float32)


def nvfp4_gemv_fused(
    x_even: torch.Tensor,
    x_odd: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
) -> torch.Tensor:
    """y [M, N] fp32 from x's even / odd columns (fp32 [M, K/2], contiguous), weight uint8 [N, K/2] (low
    nibble = even column), scale float8_e4m3fn [N, K/16], global_scale fp32 [N]. Eager torch
    materialises [M, N, K/2] temporaries; `nvfp4_linear_cpu` runs it compiled."""
    n = weight.shape[0]
    codes = weight.view(1, n, -1, 8).to(torch.int32)
    x_lo = x_even.view(x_even.shape[0], 1, -1, 8)
    x_hi = x_odd.view(x_odd.shape[0], 1, -1, 8)
    v = _e2m1_times4(codes & 15) * x_lo + _e2m1_times4(codes >> 4) * x_hi
    return (v * scale.to(torch.float32)[None, :, :, None]).sum((-1, -2)) * (global_scale * 0.25)


def nvfp4_dequantize_fused(
    weight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """The fp32 weight [N, K] (e2m1 * E4M3 scale * global scale, exact), in one pass over the packed bytes
    when compiled: for M > cpu_fused.MAX_M, where decoding once and multiplying beats decoding per row."""
    n = weight.shape[0]
    codes = weight.view(n, -1, 8).to(torch.int32)
    pairs = torch.stack([_e2m1_times4(codes & 15), _e2m1_times4(codes >> 4)], dim=-1)  # [N, K/16, 8, 2]
    w = pairs * (scale.to(torch.float32) * (global_scale.reshape(-1, 1) * 0.25))[:, :, None, None]
    return w.reshape(n, -1)


def _bf16_prefill(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, gs: torch.Tensor
) -> torch.Tensor:
    """bf16 x, more than cpu_fused.MAX_M rows, the SIMD extension: the codes times block scales decoded
    exactly to bf16 in row blocks (~4 MB, reused) by the extension, x's columns permuted to their order, a
    bf16 matmul (oneDNN, fp32 accumulation), then the global scale in fp32. The matmul rounds its output to
    bf16 before the global scale: each output is within one bf16 ulp of the reference's single rounding.
    fp32 [M, N]."""
    n, k = weight.shape[0], x.shape[1]
    rows = cpu_fused.block_rows(k, 16)
    xp = cpu_simd.nvfp4_x_perm(x)
    parts = []
    for i in range(0, n, rows):
        w = cpu_simd.nvfp4_dequant_bf16_perm(weight[i : i + rows], weight_scale[i : i + rows])
        parts.append((xp @ w.t()).float() * gs[i : i + rows])
    return torch.cat(parts, dim=1)


def nvfp4_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    int8: cpu_simd.Vnni16Weight | None = None,
) -> torch.Tensor:
    """nvfp4_linear_ref's contract (x [M, K], weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], global
    scale one element or one per row), compiled on large matrices, the extension up to its rows on any
    size (outside a compiled step), else the reference. int8: the weight's
    copy for the int8-activation kernel (cpu_simd.nvfp4_vnni_gemm), taken at every size and row count (no
    compile; calls of up to cpu_simd.INT8_MAX_M rows, each row's activations rounded on their own, so the
    same bits), except inside a compiled step (the extension call is not traceable)."""
    m, k = x.shape
    n = weight.shape[0]
    if int8 is not None and not torch.compiler.is_compiling():
        return cpu_fused.finish(cpu_simd.nvfp4_vnni_gemm(x, int8), bias, x.dtype)

    def reference() -> torch.Tensor:
        return nvfp4_linear_ref(x, weight, weight_scale, global_scale, bias)

    avx = cpu_simd.available()
    if not cpu_fused.applies(n, k):
        # small matrices: the extension too (no compile involved), else the reference, which decodes the
        # whole weight on every call (~2 ms for a 4096 x 128 KDA projection, ~25x the extension's call)
        if avx and m <= cpu_simd.NVFP4_MAX_M and k % 16 == 0 and not torch.compiler.is_compiling():
            gs = global_scale.to(torch.float32).reshape(-1).expand(n).contiguous()
            return cpu_fused.finish(cpu_simd.nvfp4_gemv_simd(x, weight, weight_scale, gs), bias, x.dtype)
        return reference()
    gs = global_scale.to(torch.float32).reshape(-1).expand(n).contiguous()  # [N]: see cpu_fused
    if avx and m > cpu_fused.MAX_M and x.dtype == torch.bfloat16 and k % 32 == 0:
        y = _bf16_prefill(x, weight, weight_scale, gs)
    elif avx and m <= cpu_simd.NVFP4_MAX_M:  # x86 with AVX-512 / AVX2: the permute-decode extension
        y = cpu_simd.nvfp4_gemv_simd(x, weight, weight_scale, gs)
    elif m <= cpu_fused.MAX_M:
        xf = x.to(torch.float32)
        y = cpu_fused.run(nvfp4_gemv_fused, xf[:, 0::2].contiguous(), xf[:, 1::2].contiguous(), weight,
                          weight_scale, gs)  # fmt: skip
    else:
        y = cpu_fused.dequantized_matmul(
            x.to(torch.float32), n, cpu_fused.block_rows(k, 16), nvfp4_dequantize_fused,
            lambda i, j: (weight[i:j], weight_scale[i:j], gs[i:j]),
        )  # fmt: skip
    if y is None:  # the compile failed: the reference, now and from then on
        return reference()
    return cpu_fused.finish(y, bias, x.dtype)
