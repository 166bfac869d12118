"""NVFP4 W4A16 linear in Triton: E2M1 weights and E4M3 group-16 scales decoded in registers.

y[M, N] = (x[M, K] @ (e2m1(W) * s)[N, K]^T) * global_scale (+ bias), fp32 accumulation.

e2m1 * s has at most 2 + 4 significant bits and lies in [2^-10, 2688], so every decoded weight is exact in
bf16 and fp16: the only roundings are the tensor-core products/sums (fp32) and the final output cast. The
global scale is applied once, to the fp32 accumulator.

Two launches, picked by the caller (see `__init__`):
- `nvfp4_gemm`: one tiled kernel for every M. Decode (small M) streams the weight bytes once with BM = 16;
  prefill uses large tiles so each decoded weight tile is reused by BM rows of x.
- `nvfp4_dequantize`: writes the bf16/fp16 weight (global scale folded in) so prefill can call cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp16 bits (sign << 15 | mag << 9) read the 3-bit E2M1 magnitude as exponent/mantissa bits; the value is
# the E2M1 value times 2^-14, subnormals included (0.5 -> 2^-15), so 2^14 is folded into the group scale.
_E2M1_FP16_UNSCALE = tl.constexpr(16384.0)


@triton.jit
def _decode_tile(p, s, BN: tl.constexpr, BK: tl.constexpr, OUT_DTYPE: tl.constexpr, DECODE: tl.constexpr):
    """p: uint8 [BN, BK/2] packed E2M1 (low nibble = even k); s: uint8 [BN, BK/16] E4M3 bits.

    Returns the [BN, BK] tile e2m1 * s in OUT_DTYPE. DECODE picks the instruction mix (same values):
    0: nibble -> fp16 bits (value * 2^-14) -> fp32 multiply by the scale.
    1: nibble -> E4M3 bits (value * 2^-6, subnormal 0.5 included) -> fp16 by the packed fp8 convert; the
       scale multiply stays in fp16 for fp16 outputs (e2m1 * s * 2^-6 * 64 is exact there).
    """
    if DECODE == 0:
        p16 = p.to(tl.uint16)
        lo = ((p16 & 0x8) << 12) | ((p16 & 0x7) << 9)
        hi = ((p16 & 0x80) << 8) | ((p16 & 0x70) << 5)
        bits = tl.reshape(tl.join(lo, hi), (BN, BK))  # [BN, BK/2, 2] -> k = 2j + {0, 1}
        val = bits.to(tl.float16, bitcast=True).to(tl.float32)
        scale = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _E2M1_FP16_UNSCALE  # [BN, BK/16]
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 16)), (BN, BK))
        w = (val * scale).to(OUT_DTYPE)
    else:
        # magnitude bits e1 e0 m -> E4M3 exponent bits 4-3 and mantissa bit 2, sign -> bit 7
        lo = ((p & 0x7) << 2) | ((p & 0x8) << 4)
        hi = ((p >> 2) & 0x1C) | (p & 0x80)
        e4 = tl.reshape(tl.join(lo, hi), (BN, BK)).to(tl.float8e4nv, bitcast=True)
        if OUT_DTYPE == tl.float16:
            scale = s.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 16)), (BN, BK))
            w = e4.to(tl.float16) * scale
        else:
            scale = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 16)), (BN, BK))
            w = (e4.to(tl.float16).to(tl.float32) * scale).to(OUT_DTYPE)
    return w


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_xm,
    stride_ym,
    K: tl.constexpr,
    PER_COL_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_kp = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 16)
    mask_m = offs_m < M
    mask_n = offs_n < N
    half_k = K // 2
    k_groups = K // 16

    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * half_k + offs_kp[None, :]
    s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * k_groups + offs_ks[None, :]

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        p = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_kp[None, :] < half_k - k0 // 2), other=0)
        s = tl.load(s_ptrs, mask=mask_n[:, None] & (offs_ks[None, :] < k_groups - k0 // 16), other=0)
        w = _decode_tile(p, s, BN, BK, x_ptr.dtype.element_ty, DECODE)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BK
        w_ptrs += BK // 2
        s_ptrs += BK // 16

    if PER_COL_GS:
        gs = tl.load(gs_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * gs[None, :]
    else:
        acc = acc * tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nvfp4_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K,
    PER_COL_GS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_kp = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    offs_ks = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_n = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    p = tl.load(
        w_ptr + rows * (K // 2) + offs_kp[None, :], mask=mask_n[:, None] & (offs_kp[None, :] < K // 2)
    )
    s = tl.load(
        s_ptr + rows * (K // 16) + offs_ks[None, :], mask=mask_n[:, None] & (offs_ks[None, :] < K // 16)
    )
    w = _decode_tile(p, s, BN, BK, tl.float32, 0)
    if PER_COL_GS:
        w = w * tl.load(gs_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    else:
        w = w * tl.load(gs_ptr)
    mask = mask_n[:, None] & (offs_k[None, :] < K)
    tl.store(out_ptr + rows * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def _check(
    x: torch.Tensor | None, weight: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor
) -> tuple[int, int]:
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"nvfp4 weight: expected contiguous uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape[0], weight.shape[1] * 2
    if k % 16:
        raise ValueError(f"nvfp4 weight: K={k} must be a multiple of 16")
    if scale_u8.dtype != torch.uint8 or tuple(scale_u8.shape) != (n, k // 16) or not scale_u8.is_contiguous():
        raise ValueError(
            f"nvfp4 weight_scale: expected contiguous E4M3 bits as uint8 {(n, k // 16)}, "
            f"got {scale_u8.dtype} {tuple(scale_u8.shape)}"
        )
    if (
        global_scale.dtype != torch.float32
        or global_scale.numel() not in (1, n)
        or not global_scale.is_contiguous()
    ):
        raise ValueError(
            f"nvfp4 global scale: expected contiguous fp32 with 1 or N={n} elements, "
            f"got {global_scale.dtype} {tuple(global_scale.shape)}"
        )
    if x is not None:
        if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(
                f"nvfp4 linear input: expected [M, {k}] with unit stride along K, got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"nvfp4 linear input: expected bf16/fp16/fp32, got {x.dtype}")
    return n, k


def nvfp4_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 3,
    decode: int = 0,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T * global_scale (+ bias) with one fixed launch configuration.

    x bf16/fp16/fp32; weight uint8 [N, K/2]; scale_u8 [N, K/16] (E4M3 bits); global_scale fp32 [1] or [N].
    """
    n, k = _check(x, weight, scale_u8, global_scale)
    if block_k % 32 or block_m < 16 or block_n < 16:
        raise ValueError(f"nvfp4_gemm: block_k={block_k} must be a multiple of 32, blocks >= 16")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"nvfp4 bias: expected contiguous [{n}], got {tuple(bias.shape)}")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _nvfp4_gemm_kernel[grid](
        x,
        weight,
        scale_u8,
        global_scale,
        bias if bias is not None else global_scale,
        y,
        m,
        n,
        x.stride(0),
        y.stride(0),
        K=k,
        PER_COL_GS=global_scale.numel() == n and n != 1,
        HAS_BIAS=bias is not None,
        BM=block_m,
        BN=block_n,
        BK=block_k,
        GROUP_M=group_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DECODE=decode,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def nvfp4_dequantize(
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    block_n: int = 32,
    block_k: int = 256,
) -> torch.Tensor:
    """The dense [N, K] weight e2m1 * s * global_scale in `dtype` (one rounding per element)."""
    n, k = _check(None, weight, scale_u8, global_scale)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _nvfp4_dequant_kernel[grid](
        weight,
        scale_u8,
        global_scale,
        out,
        n,
        k,
        PER_COL_GS=global_scale.numel() == n and n != 1,
        BN=block_n,
        BK=block_k,
    )
    return out
