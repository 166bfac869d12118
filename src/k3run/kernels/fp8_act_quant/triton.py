"""Dynamic per-token 1x128 FP8 activation quantization as one Triton kernel, bit-exact with formats.

Per row m and group g of 128 columns: scale = max(amax, 1e-10) / 448, q = RNE_e4m3(clamp(x / scale, +-448)),
both divisions IEEE round-to-nearest (tl.div_rn) like torch's. Rows M..M'-1 (padding to a multiple the GEMM
wants) are written as zeros with their finite scale, so no separate pad copy is needed. The scale tensor may
be strided (outer-dim-major [M', K/128] for torch._scaled_mm is written directly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-10)


@triton.jit
def _e4m3_rne_bits(q):
    """fp32 q with |q| <= 448 -> E4M3 bit pattern (uint8), round to nearest even, by integer arithmetic.

    The Triton interpreter's fp32 -> fp8 cast does not round like the hardware, so the interpreter runs
    this exact version; compiled kernels use the cvt instruction (RNE, satfinite on sm89+).
    """
    bits = q.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal range (>= 2^-6): round the 23-bit mantissa to 3 bits, ties to even; a carry bumps the exponent
    r = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal range: multiples of 2^-9, rounded with the fp32 2^23 trick (exact below 8)
    a = mag.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_groups(x, AXIS: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """fp32 x with its 128-column groups along AXIS -> (E4M3 bits uint8 like x, scale fp32 with AXIS
    reduced): scale = max(amax, 1e-10) / 448 and q = RNE_e4m3(clamp(x / scale, +-448)), both divisions IEEE
    (tl.div_rn), so the bits equal formats.quantize_fp8_act_1x128's. EXACT_ROUND: integer rounding (the
    interpreter), else the hardware cvt (RNE, satfinite). Also used by the FP8 decode GEMV (fp8_gemm.gemv)."""
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=AXIS), AMAX_FLOOR), FP8_MAX)
    q = tl.div_rn(x, tl.expand_dims(scale, AXIS))
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if EXACT_ROUND:
        qb = _e4m3_rne_bits(q)
    else:
        qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return qb, scale


@triton.jit
def _fp8_act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    M_OUT,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    BM: tl.constexpr,
    G: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_g = pid_g * G + tl.arange(0, G)
    offs_c = tl.arange(0, 128)
    cols = offs_g[:, None] * 128 + offs_c[None, :]  # [G, 128]
    rows = offs_m[:, None, None].to(tl.int64)
    in_x = (offs_m < M)[:, None, None] & (cols < K)[None, :, :]
    x = tl.load(x_ptr + rows * stride_xm + cols[None, :, :], mask=in_x, other=0.0).to(tl.float32)

    qb, scale = quantize_groups(x, 2, EXACT_ROUND)  # [BM, G, 128] bits, [BM, G]

    in_out = (offs_m < M_OUT)[:, None, None] & (cols < K)[None, :, :]
    tl.store(q_ptr + rows * stride_qm + cols[None, :, :], qb, mask=in_out)
    s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_g[None, :] * stride_sg
    tl.store(s_ptrs, scale, mask=(offs_m < M_OUT)[:, None] & (offs_g < K // 128)[None, :])


def fp8_act_quant(
    x: torch.Tensor,
    *,
    m_multiple: int = 1,
    scale_outer_major: bool = False,
    block_m: int = 4,
    groups_per_program: int = 4,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16/fp32 (K % 128 == 0, unit stride along K) -> (q fp8 [M', K], scale fp32 [M', K/128]).

    M' is M rounded up to `m_multiple`; with scale_outer_major the scale has strides (1, M').
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8_act_quant x: expected [M, K] with unit stride along K, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_act_quant x: expected bf16/fp16/fp32, got {x.dtype}")
    m, k = x.shape
    if k % 128:
        raise ValueError(f"fp8_act_quant x: K={k} must be a multiple of 128")
    if groups_per_program & (groups_per_program - 1) or block_m & (block_m - 1):
        raise ValueError("fp8_act_quant: block_m and groups_per_program must be powers of two")
    m_out = -(-m // m_multiple) * m_multiple
    q = torch.empty((m_out, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_outer_major:
        scale = torch.empty((k // 128, m_out), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((m_out, k // 128), dtype=torch.float32, device=x.device)
    if m_out == 0:
        return q, scale
    grid = (triton.cdiv(m_out, block_m), triton.cdiv(k // 128, groups_per_program))
    _fp8_act_quant_kernel[grid](
        x,
        q.view(torch.uint8),
        scale,
        m,
        m_out,
        k,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        scale.stride(1),
        BM=block_m,
        G=groups_per_program,
        EXACT_ROUND=not x.is_cuda,
        num_warps=num_warps,
    )
    return q, scale
