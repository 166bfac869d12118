"""FP8_PB_WO at decode sizes (M <= 16): a split-K GEMV with the 1x128 activation quantization fused in.

Why: at M = 1..16 the layer is a weight stream. Block-wise torch._scaled_mm reads 7168x7168 FP8 weights at
~2.35 TB/s on an H200 and the whole layer (quantize launch + GEMM + crop / bias) at ~1.9 TB/s effective
(bench/RESULTS.md). Here one launch reads each weight once and quantizes x itself, and a second, tiny
one sums the K splits, adds the bias and writes only the logical columns.

Program (n block of BN rows, K split s) walks its 128-column groups kb: it quantizes the x group exactly as
`quantize_fp8_act_1x128` does (scale = max(amax, 1e-10) / 448 with IEEE division, q = RNE_e4m3(clamp(x /
scale, +-448)); every program of the group recomputes the same values), takes the group's partial product
q [16, 128] x w[BN, 128]^T on the tensor cores in fp16 (E4M3 values are exact in fp16 and their products
exact in the fp32 accumulator), and adds partial * s_x[m, kb] * s_w[n // 128, kb] to its fp32 accumulator.
So the result is the reference's sum of (q_x s_x)(q_w s_w) up to fp32 summation order. The K splits go to
an fp32 workspace [split, M, N_pad] summed in split order by `_reduce_kernel` (deterministic). Above two rows
x is quantized once by the 1x128 kernel instead (`prequant`), which the measurements favour there.

Measured on an H200 (bench/RESULTS.md, bf16, against quantize + _scaled_mm + crop / bias): 1.15-1.68x
faster at M = 1 on the K3 shapes (7168^2: 19.8 against 25.6 us, 2.6 TB/s), 1.03-1.43x at M = 2..16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.fp8_act_quant.triton import quantize_groups
from k3run.kernels.fp8_gemm import FP8_GEMV_MAX_M  # the token tile (one mma row block)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    ws_ptr,
    M,
    N_PAD,
    stride_xm,
    stride_sxm,
    stride_wn,
    stride_swn,
    KB_PER_SPLIT,
    BN: tl.constexpr,
    PREQUANT: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, 128)
    row_ok = offs_m < M
    sw_row = sw_ptr + (pid_n * BN // 128) * stride_swn
    acc = tl.zeros((16, BN), dtype=tl.float32)
    kb0 = pid_s * KB_PER_SPLIT
    for i in range(KB_PER_SPLIT):
        kb = kb0 + i
        cols = kb * 128 + offs_k
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :])  # [BN, 128] e4m3
        if PREQUANT:  # x quantized by fp8_act_quant: q [M, K] e4m3, scale [M, K / 128]
            q8 = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None], other=0.0)
            scale = tl.load(sx_ptr + offs_m * stride_sxm + kb, mask=row_ok, other=0.0)
        else:
            # rows past M read 1.0, not 0: IEEE division takes a slow path for a zero numerator over the
            # tiny floor scale (2^-43), which makes M = 1 twice as slow as M = 16 (H200); never stored
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None], other=1.0)
            qb, scale = quantize_groups(x.to(tl.float32), 1, EXACT_ROUND)  # [16, 128] bits, [16]
            q8 = qb.to(tl.float8e4nv, bitcast=True)
        part = tl.dot(q8.to(tl.float16), tl.trans(w.to(tl.float16)))  # [16, BN] fp32, exact products
        s_w = tl.load(sw_row + kb)
        acc += part * (scale[:, None] * s_w)
    ws = ws_ptr + (pid_s * M + offs_m[:, None]) * N_PAD + offs_n[None, :]
    tl.store(ws, acc, mask=row_ok[:, None])


@triton.jit
def _reduce_kernel(
    ws_ptr, b_ptr, y_ptr, M, N, N_PAD, stride_ym, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):  # in split order: the same bits for the same split
        acc += tl.load(ws_ptr + (s * M + m) * N_PAD + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def gemv_split(n_pad: int, k: int, block_n: int, sms: int, per_sm: int = 3) -> int:
    """The K split: the largest divisor of the 128-column group count K / 128 (at most 16) that keeps the
    grid (N_pad / block_n row blocks x split) within ~`per_sm` programs per SM."""
    groups, blocks = k // 128, n_pad // block_n
    fit = max(1, min(16, (sms * per_sm) // max(blocks, 1)))
    return max(d for d in range(1, fit + 1) if groups % d == 0)


def fp8_gemv(
    x: torch.Tensor,
    weight_padded: torch.Tensor,
    scale_2d: torch.Tensor,
    n_logical: int,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 128,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    prequant: bool | None = None,
) -> torch.Tensor:
    """y [M, n_logical] = quant_1x128(x) @ weight_padded[:n_logical]^T (+ bias) in x's dtype, for M <= 16.

    x [M, K] bf16 / fp16 / fp32 (unit stride along K, K % 128 == 0); weight_padded fp8 e4m3 [N_pad, K]
    (N_pad % 128 == 0); scale_2d fp32 [N_pad / 128, K / 128]. Operands are checked by the caller
    (`fp8_pb_wo_linear`). prequant: quantize x first with the 1x128 kernel (fp8_act_quant) and let the GEMV
    read q and the scales instead of quantizing every 128-column group in every program; None: for M > 2
    (H200, bench/RESULTS.md: fused is faster at M = 1 on every K3 shape, prequant at M = 4..16 on all but
    one). No host synchronisation: graph-capturable."""
    m, k = x.shape
    if not 1 <= m <= FP8_GEMV_MAX_M:
        raise ValueError(f"fp8_gemv: M={m} rows; the decode kernel takes 1..{FP8_GEMV_MAX_M}")
    if 128 % block_n or block_n < 16:
        raise ValueError(f"fp8_gemv: block_n={block_n} must divide 128 (and be >= 16)")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_pad = weight_padded.shape[0]
    if split_k is None:
        from k3run.kernels.nvfp4_gemm import sm_count

        sms = sm_count(x.device.index or 0) if x.is_cuda else 1
        split_k = gemv_split(n_pad, k, block_n, sms)
    if (k // 128) % split_k:
        raise ValueError(f"fp8_gemv: split_k={split_k} must divide K / 128 = {k // 128}")
    ws = torch.empty((split_k, m, n_pad), dtype=torch.float32, device=x.device)
    if prequant is None:
        prequant = m > 2
    if prequant:
        from k3run.kernels.fp8_act_quant import quantize_act_1x128

        xin, sx = quantize_act_1x128(x)
    else:
        xin, sx = x, scale_2d  # sx unused
    _fp8_gemv_kernel[(n_pad // block_n, split_k)](
        xin, sx, weight_padded, scale_2d, ws, m, n_pad, xin.stride(0), sx.stride(0),
        weight_padded.stride(0), scale_2d.stride(0), (k // 128) // split_k,
        BN=block_n, PREQUANT=prequant, EXACT_ROUND=not x.is_cuda, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    y = torch.empty((m, n_logical), dtype=x.dtype, device=x.device)
    block = 1024
    _reduce_kernel[(m, triton.cdiv(n_logical, block))](
        ws, bias if bias is not None else ws, y, m, n_logical, n_pad, y.stride(0), split_k,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return y
