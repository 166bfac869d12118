"""Block-scaled FP8 GEMM in Triton (the fallback when block-wise torch._scaled_mm is unavailable).

y[M, N] = sum_kb (q_x[:, kb] @ q_w[:, kb]^T) * s_x[m, kb] * s_w[n // 128, kb], fp32 accumulation, output cast
once. One K step is one 128-column scale group, so each partial product is scaled exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over a [M, N] output in BM x BN tiles, in grouped order: GROUP_M row
    tiles run one after another on each column tile, so they share its weight tile while it is in L2."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    sx_ptr,
    w_ptr,
    sw_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_sxm,
    stride_sxk,
    stride_wn,
    stride_swn,
    stride_ym,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    BK: tl.constexpr = 128
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    sx_ptrs = sx_ptr + offs_m.to(tl.int64) * stride_sxm
    sw_ptrs = sw_ptr + (offs_n // 128) * stride_swn

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        sx = tl.load(sx_ptrs + kb * stride_sxk, mask=mask_m, other=0.0)
        sw = tl.load(sw_ptrs + kb, mask=mask_n, other=0.0)
        part = tl.dot(x, tl.trans(w))
        acc += part * sx[:, None] * sw[None, :]
        x_ptrs += BK
        w_ptrs += BK

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_gemm(
    q_x: torch.Tensor,
    scale_x: torch.Tensor,
    q_w: torch.Tensor,
    scale_w: torch.Tensor,
    n_out: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    block_m: int = 64,
    block_n: int = 128,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """q_x fp8 [M, K], scale_x fp32 [M, K/128] (any strides), q_w fp8 [N, K] (rows may be padded beyond
    n_out), scale_w fp32 [ceil(N/128), K/128] -> y [M, n_out] in out_dtype (+ bias [n_out])."""
    if q_x.dtype != torch.float8_e4m3fn or q_w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm: expected float8_e4m3fn operands, got {q_x.dtype}, {q_w.dtype}")
    if q_x.dim() != 2 or q_w.dim() != 2 or q_x.shape[1] != q_w.shape[1]:
        raise ValueError(f"fp8_block_gemm: shapes {tuple(q_x.shape)} x {tuple(q_w.shape)}^T do not chain")
    m, k = q_x.shape
    n = q_w.shape[0]
    if k % 128 or q_x.stride(1) != 1 or q_w.stride(1) != 1:
        raise ValueError(f"fp8_block_gemm: K={k} must be a multiple of 128 with unit stride along K")
    if tuple(scale_x.shape) != (m, k // 128) or scale_x.dtype != torch.float32:
        raise ValueError(f"fp8_block_gemm scale_x: expected fp32 {(m, k // 128)}, got {tuple(scale_x.shape)}")
    nb = -(-n // 128)
    if tuple(scale_w.shape) != (nb, k // 128) or scale_w.dtype != torch.float32 or scale_w.stride(1) != 1:
        raise ValueError(
            f"fp8_block_gemm scale_w: expected fp32 {(nb, k // 128)}, got {tuple(scale_w.shape)}"
        )
    if not 0 < n_out <= n or 128 % block_n:
        raise ValueError(f"fp8_block_gemm: n_out={n_out} must be in 1..{n}; block_n must divide 128")
    if bias is not None and (bias.shape != (n_out,) or not bias.is_contiguous()):
        raise ValueError(f"fp8_block_gemm bias: expected contiguous [{n_out}], got {tuple(bias.shape)}")
    y = torch.empty((m, n_out), dtype=out_dtype, device=q_x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n_out, block_n),)
    _fp8_block_gemm_kernel[grid](
        q_x,
        scale_x,
        q_w,
        scale_w,
        bias if bias is not None else scale_w,
        y,
        m,
        n_out,
        q_x.stride(0),
        scale_x.stride(0),
        scale_x.stride(1),
        q_w.stride(0),
        scale_w.stride(0),
        y.stride(0),
        K=k,
        HAS_BIAS=bias is not None,
        BM=block_m,
        BN=block_n,
        GROUP_M=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
