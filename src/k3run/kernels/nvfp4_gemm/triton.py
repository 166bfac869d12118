"""NVFP4 W4A16 linear in Triton: E2M1 weights and E4M3 group-16 scales decoded in registers.

y[M, N] = (x[M, K] @ (e2m1(W) * s)[N, K]^T) * global_scale (+ bias), fp32 accumulation.

e2m1 * s has at most 2 + 4 significant bits and lies in [2^-10, 2688], so every decoded weight is exact in
bf16 and fp16: the only roundings are the tensor-core sums (fp32) and the final output cast. The global scale
is applied once, to the fp32 accumulator.

Kernel weight layout ("split128", made once by `k3run.kernels.nvfp4_gemm.repack_split128`): K is
padded to a multiple of 128, and each 128-wide chunk of a row is stored as 64 bytes whose LOW nibbles
hold k = 0..63 of the chunk and whose HIGH nibbles hold k = 64..127. A loaded byte tile then decodes
into two tiles that each match a contiguous run of x columns, so no interleaving (join/reshape shuffles)
is needed before the two tensor-core dots. Scales keep the checkpoint layout [N, K/16], zero-padded.

Decoders (same values): DECODE=0 is portable Triton (interpreter, fp32 inputs); DECODE=1 is PTX inline
assembly for bf16/fp16 (byte permutes as a 16-entry table, then one packed multiply by the scale): about
3 instructions per weight inside the asm, 5.8 per weight for the whole K loop of a 16x64x256 tile (sm_90
SASS) against 10.5 for DECODE=0.

Measured on an H200 (bench/RESULTS.md): M <= 16 runs at ~0.7 TB/s of weight bytes, 0.7-0.8x cuBLAS bf16,
well short of the bandwidth ceiling; bench/NOTES.md has the analysis. For M > 16 the dispatcher prefers
`nvfp4_dequantize` + cuBLAS (1.05x cuBLAS bf16 at M = 4096 on 7168x7168).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.fp8_gemm.triton import grouped_tile
from k3run.kernels.nvfp4_gemm import CHUNK, TILED_PAIR_BITS

# fp16 bits (sign << 15 | mag << 9) read the 3-bit E2M1 magnitude as exponent/mantissa bits; the value is
# the E2M1 value times 2^-14, subnormals included (0.5 -> 2^-15), so 2^14 is folded into the group scale.
_E2M1_FP16_UNSCALE = tl.constexpr(16384.0)

# PRMT tables (lo word, hi word): byte i is the high (or low) byte of the 16-bit float of E2M1 magnitude i.
# bf16: 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0000 3F00 3F80 3FC0 4000 4040 4080 40C0; fp16: 0000 3800 3C00 3E00 4000
# 4200 4400 4600 (all low bytes zero).
PRMT_TABLES = {
    "bf16": ((0x3F3F3F00, 0x40404040), (0xC0800000, 0xC0804000)),
    "fp16": ((0x3E3C3800, 0x46444240), (0x00000000, 0x00000000)),
}
# One call: $4 = 4 split128 bytes b0..b3 (nibbles b0lo b0hi b1lo ... at bits 0-3, 4-7, ...); $5,$6 / $7,$8 =
# the low / high nibbles' scales as packed pairs. Outputs $0,$1 = decoded low nibbles (b0,b1), (b2,b3) and
# $2,$3 = high nibbles, each a packed pair: magnitudes by table lookup, sign bits moved to bit 15 of each
# half, then one packed multiply by the scale.
_ASM_TEMPLATE = """
{
.reg .b32 th0, th1, tl0, tl1, m, m2, h01, l01, h23, l23, t, u, z, sg;
mov.b32 th0, HB0; mov.b32 th1, HB1; mov.b32 tl0, LB0; mov.b32 tl1, LB1; mov.b32 z, 0;
and.b32 m, $4, 0x77777777;
shr.b32 m2, m, 16;
prmt.b32 h01, th0, th1, m;
prmt.b32 l01, tl0, tl1, m;
prmt.b32 h23, th0, th1, m2;
prmt.b32 l23, tl0, tl1, m2;
prmt.b32 $0, l01, h01, 0x6240;
prmt.b32 $1, l23, h23, 0x6240;
prmt.b32 $2, l01, h01, 0x7351;
prmt.b32 $3, l23, h23, 0x7351;
shl.b32 t, $4, 4;
and.b32 t, t, 0x80808080;
and.b32 u, $4, 0x80808080;
prmt.b32 sg, t, z, 0x1404;
or.b32 $0, $0, sg;
prmt.b32 sg, t, z, 0x3424;
or.b32 $1, $1, sg;
prmt.b32 sg, u, z, 0x1404;
or.b32 $2, $2, sg;
prmt.b32 sg, u, z, 0x3424;
or.b32 $3, $3, sg;
mul.rn.TY $0, $0, $5;
mul.rn.TY $1, $1, $6;
mul.rn.TY $2, $2, $7;
mul.rn.TY $3, $3, $8;
}
"""


def decode_asm(kind: str) -> str:
    """The PTX of DECODE=1 for kind "bf16" or "fp16" (also read by the CPU test that emulates it)."""
    (hb0, hb1), (lb0, lb1) = PRMT_TABLES[kind]
    subs = {"HB0": hb0, "HB1": hb1, "LB0": lb0, "LB1": lb1}
    text = _ASM_TEMPLATE.replace("TY", "bf16x2" if kind == "bf16" else "f16x2")
    for key, val in subs.items():
        text = text.replace(key, f"0x{val:08X}")
    return text


_ASM_BF16 = tl.constexpr(decode_asm("bf16"))
_ASM_FP16 = tl.constexpr(decode_asm("fp16"))


@triton.jit
def _decode_split(p, s_lo, s_hi, OUT_DTYPE: tl.constexpr, DECODE: tl.constexpr):
    """p: uint8 [BN, G, 16] split128 bytes; s_lo / s_hi: uint8 [BN, G, 1] E4M3 scale bits of the low / high
    nibbles' groups. Returns (w_lo, w_hi), each [BN, G, 16] = e2m1 * s in OUT_DTYPE."""
    if DECODE == 1:
        sl = s_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(OUT_DTYPE)
        sh = s_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(OUT_DTYPE)
        if OUT_DTYPE == tl.bfloat16:
            w_lo, w_hi = tl.inline_asm_elementwise(
                asm=_ASM_BF16,
                constraints="=r,=r,=r,=r,r,r,r,r,r",
                args=[p, sl, sh],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
        else:
            w_lo, w_hi = tl.inline_asm_elementwise(
                asm=_ASM_FP16,
                constraints="=r,=r,=r,=r,r,r,r,r,r",
                args=[p, sl, sh],
                dtype=(tl.float16, tl.float16),
                is_pure=True,
                pack=4,
            )
    else:
        p16 = p.to(tl.uint16)
        lo = ((p16 & 0x8) << 12) | ((p16 & 0x7) << 9)
        hi = ((p16 & 0x80) << 8) | ((p16 & 0x70) << 5)
        sl = s_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _E2M1_FP16_UNSCALE
        sh = s_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _E2M1_FP16_UNSCALE
        w_lo = (lo.to(tl.float16, bitcast=True).to(tl.float32) * sl).to(OUT_DTYPE)
        w_hi = (hi.to(tl.float16, bitcast=True).to(tl.float32) * sh).to(OUT_DTYPE)
    return w_lo, w_hi


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    M,
    N,
    stride_xm,
    stride_ym,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PER_COL_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DECODE: tl.constexpr,
):
    G: tl.constexpr = BK // 32  # 16-byte groups per tile; each holds 16 low-nibble and 16 high-nibble weights
    K_SPLIT: tl.constexpr = K_PAD // SPLIT_K  # the wrapper makes it a multiple of BK
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_g = tl.arange(0, G)
    offs_b = tl.arange(0, 16)
    # x columns of the tile's low-nibble weights: chunk c, positions 0..63 (the high nibbles: 64..127)
    offs_c = tl.arange(0, BK // 128)
    offs_j = tl.arange(0, 64)
    k_lo = offs_c[:, None] * 128 + offs_j[None, :]  # [BK/128, 64]
    # scale group of tile group g (low nibbles); the high nibbles' groups are 4 further
    sg_lo = (offs_g // 4) * 8 + offs_g % 4

    rows_n = offs_n.to(tl.int64)[:, None, None]
    k_start = pid_k * K_SPLIT
    w_ptrs = (
        w_ptr + rows_n * (K_PAD // 2) + k_start // 2 + (offs_g[:, None] * 16 + offs_b[None, :])[None, :, :]
    )
    s_ptrs = s_ptr + rows_n * (K_PAD // 16) + k_start // 16 + sg_lo[None, :, None]
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None, None] * stride_xm + k_start + k_lo[None, :, :]

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, K_SPLIT, BK):
        k0 = k_start + kt
        p = tl.load(w_ptrs, mask=mask_n[:, None, None], other=0)
        s_lo = tl.load(s_ptrs, mask=mask_n[:, None, None], other=0)
        s_hi = tl.load(s_ptrs + 4, mask=mask_n[:, None, None], other=0)
        if K == K_PAD:
            x_lo = tl.load(x_ptrs, mask=mask_m[:, None, None], other=0.0)
            x_hi = tl.load(x_ptrs + 64, mask=mask_m[:, None, None], other=0.0)
        else:
            x_lo = tl.load(x_ptrs, mask=mask_m[:, None, None] & (k_lo[None] < K - k0), other=0.0)
            x_hi = tl.load(x_ptrs + 64, mask=mask_m[:, None, None] & (k_lo[None] + 64 < K - k0), other=0.0)
        x_lo = tl.reshape(x_lo, (BM, BK // 2))
        x_hi = tl.reshape(x_hi, (BM, BK // 2))
        w_lo, w_hi = _decode_split(p, s_lo, s_hi, x_ptr.dtype.element_ty, DECODE)
        w_lo = tl.reshape(w_lo, (BN, BK // 2))
        w_hi = tl.reshape(w_hi, (BN, BK // 2))
        acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=DOT_PRECISION)
        w_ptrs += BK // 2
        s_ptrs += BK // 16
        x_ptrs += BK

    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        # fp32 partial sums [SPLIT_K, M, N]; _split_k_epilogue adds them and applies the scales
        ws_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=mask_mn)
    else:
        if PER_COL_GS:
            gs = tl.load(gs_ptr + offs_n, mask=mask_n, other=0.0)
            acc = acc * gs[None, :]
        else:
            acc = acc * tl.load(gs_ptr)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _split_k_epilogue(
    ws_ptr,
    gs_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_ym,
    SPLIT_K: tl.constexpr,
    PER_COL_GS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[m, n] = (sum_s ws[s, m, n]) * global_scale (+ bias[n]), in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sk in range(SPLIT_K):
        acc += tl.load(ws_ptr + sk * M * N + offs, mask=mask, other=0.0)
    offs_n = offs % N
    if PER_COL_GS:
        acc = acc * tl.load(gs_ptr + offs_n, mask=mask, other=0.0)
    else:
        acc = acc * tl.load(gs_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N).to(tl.int64) * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    PER_COL_GS: tl.constexpr,
    BN: tl.constexpr,
    TILED: tl.constexpr = False,
):
    """One program: BN rows x one 128-wide chunk of the split128 layout -> the dense [N, K] weight.
    TILED: the weight is in the tiled128 order (tile_split128: 16-row blocks of 64-byte chunk rows, each
    4-byte word's bits placed for the shift decoder, TILED_PAIR_BITS)."""
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_g = tl.arange(0, 4)
    offs_b = tl.arange(0, 16)
    rows = offs_n.to(tl.int64)[:, None, None]
    byte = (offs_g[:, None] * 16 + offs_b[None, :])[None, :, :]  # [1, 4, 16] position in the 64-byte chunk
    if TILED:
        tile = (rows // 16) * (K_PAD // 128) + c
        w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        q = tl.load(w32 + tile * 256 + (rows % 16) * 16 + byte // 4, mask=mask_n[:, None, None], other=0)
        p = _untile_byte(q.to(tl.uint32, bitcast=True), byte % 4)
        # TILED_SCALE_ORDER: low group g at byte 4 (g % 2) + 2 (g // 2), its high group one byte later
        g = offs_g[None, :, None]
        s_base = s_ptr + tile * 128 + (rows % 16) * 8 + (g % 2) * 4 + (g // 2) * 2
    else:
        p = tl.load(w_ptr + rows * (K_PAD // 2) + c * 64 + byte, mask=mask_n[:, None, None], other=0)
        s_base = s_ptr + rows * (K_PAD // 16) + c * 8 + offs_g[None, :, None]
    s_lo = tl.load(s_base, mask=mask_n[:, None, None], other=0)
    s_hi = tl.load(s_base + (1 if TILED else 4), mask=mask_n[:, None, None], other=0)
    w_lo, w_hi = _decode_split(p, s_lo, s_hi, tl.float32, 0)
    if PER_COL_GS:
        gs = tl.load(gs_ptr + offs_n, mask=mask_n, other=0.0)[:, None, None]
    else:
        gs = tl.load(gs_ptr)
    k = c * 128 + byte
    out = out_ptr + rows * K + k
    tl.store(out, (w_lo * gs).to(out_ptr.dtype.element_ty), mask=mask_n[:, None, None] & (k < K))
    tl.store(out + 64, (w_hi * gs).to(out_ptr.dtype.element_ty), mask=mask_n[:, None, None] & (k + 64 < K))


_PAIR_S0 = tl.constexpr(TILED_PAIR_BITS[0][0])
_PAIR_M0 = tl.constexpr(TILED_PAIR_BITS[0][1])
_PAIR_S1 = tl.constexpr(TILED_PAIR_BITS[1][0])
_PAIR_M1 = tl.constexpr(TILED_PAIR_BITS[1][1])
_PAIR_S2 = tl.constexpr(TILED_PAIR_BITS[2][0])
_PAIR_M2 = tl.constexpr(TILED_PAIR_BITS[2][1])
_PAIR_S3 = tl.constexpr(TILED_PAIR_BITS[3][0])
_PAIR_M3 = tl.constexpr(TILED_PAIR_BITS[3][1])


@triton.jit
def _nibble(q, sign_bit, mag_bit):
    return ((q >> sign_bit) & 1) << 3 | ((q >> mag_bit) & 7)


@triton.jit
def _untile_byte(q, i):
    """Split128 byte i (0..3) of stored tiled128 words q (uint32): its low nibble is n_i = element i % 2 of
    pair i // 2, its high nibble n_{4+i} = element i % 2 of pair 2 + i // 2 (TILED_PAIR_BITS)."""
    h = (i % 2) * 16
    first = i < 2
    lo = _nibble(q, tl.where(first, _PAIR_S0, _PAIR_S1) + h, tl.where(first, _PAIR_M0, _PAIR_M1) + h)
    hi = _nibble(q, tl.where(first, _PAIR_S2, _PAIR_S3) + h, tl.where(first, _PAIR_M2, _PAIR_M3) + h)
    return (lo | (hi << 4)).to(tl.uint8)


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of n not above cap (at least 1): how many whole pieces n splits into."""
    return max(d for d in range(1, max(1, min(cap, n)) + 1) if n % d == 0)


def _check(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
) -> int:
    """Validate a kernel call's tensors (split128 layout); returns N."""
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"nvfp4 weight: expected contiguous uint8 [N, K_pad/2], got {weight.dtype} {tuple(weight.shape)}"
        )
    n, k_pad = weight.shape[0], weight.shape[1] * 2
    if k_pad % CHUNK or not 0 < k <= k_pad or k % 16 or k_pad - k >= CHUNK:
        raise ValueError(f"nvfp4 weight: K={k} (multiple of 16) must round up to the split128 width {k_pad}")
    if (
        scale_u8.dtype != torch.uint8
        or tuple(scale_u8.shape) != (n, k_pad // 16)
        or not scale_u8.is_contiguous()
    ):
        raise ValueError(
            f"nvfp4 weight_scale: expected contiguous E4M3 bits as uint8 {(n, k_pad // 16)}, "
            f"got {scale_u8.dtype} {tuple(scale_u8.shape)}"
        )
    gs_ok = global_scale.dtype == torch.float32 and global_scale.numel() in (1, n)
    if not gs_ok or not global_scale.is_contiguous():
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
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"nvfp4 bias: expected contiguous [{n}], got {tuple(bias.shape)}")
    return n


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
    split_k: int = 1,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T * global_scale (+ bias) with one fixed launch configuration.

    weight / scale_u8: split128 layout from `repack_split128` (package __init__); x bf16/fp16/fp32;
    global_scale fp32 [1] or [N]. block_k is lowered to the largest multiple of 128 dividing K_pad;
    decode=1 needs bf16/fp16 on CUDA.
    """
    n = _check(x, weight, scale_u8, global_scale, x.shape[-1], bias)
    k = x.shape[1]
    k_pad = weight.shape[1] * 2
    if block_m < 16 or block_n < 16 or block_k % CHUNK:
        raise ValueError(f"nvfp4_gemm: block_k={block_k} must be a multiple of 128, blocks >= 16")
    while k_pad % block_k:
        block_k //= 2
    block_k = max(block_k, CHUNK)
    # split K only into whole tiles: the largest divisor of the tile count not above split_k
    tiles = k_pad // block_k
    split_k = largest_divisor(tiles, split_k)
    if decode == 1 and (x.dtype == torch.float32 or not x.is_cuda):
        raise ValueError("nvfp4_gemm: decode=1 (PTX) needs bf16/fp16 inputs on a CUDA device")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    per_col = global_scale.numel() == n and n != 1
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split_k)
    _nvfp4_gemm_kernel[grid](
        x,
        weight,
        scale_u8,
        global_scale,
        bias if bias is not None else global_scale,
        y,
        ws,
        m,
        n,
        x.stride(0),
        y.stride(0),
        K=k,
        K_PAD=k_pad,
        SPLIT_K=split_k,
        PER_COL_GS=per_col,
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
    if split_k > 1:
        block = 1024
        _split_k_epilogue[(triton.cdiv(m * n, block),)](
            ws,
            global_scale,
            bias if bias is not None else global_scale,
            y,
            m,
            n,
            y.stride(0),
            SPLIT_K=split_k,
            PER_COL_GS=per_col,
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return y


def nvfp4_dequantize(
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    *,
    block_n: int = 32,
    rows: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense [N, K] weight e2m1 * s * global_scale in `dtype` (one rounding per element).
    rows: the weight is in the tiled128 order with its rows padded to 16; N = rows.
    out: a contiguous [N, K] `dtype` tensor to write (default a new one)."""
    n = _check(None, weight, scale_u8, global_scale, k)
    if rows is not None:
        if n % 16 or not n - 16 < rows <= n:
            raise ValueError(f"nvfp4 dequantize: a tiled128 weight has rows padded to 16: {n} for N={rows}")
        n = rows
    k_pad = weight.shape[1] * 2
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.device)
    elif tuple(out.shape) != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"nvfp4 dequantize: out must be a contiguous {dtype} {(n, k)}, got {out.dtype} {tuple(out.shape)}"
        )
    grid = (triton.cdiv(n, block_n), k_pad // CHUNK)
    _nvfp4_dequant_kernel[grid](
        weight,
        scale_u8,
        global_scale,
        out,
        n,
        K=k,
        K_PAD=k_pad,
        PER_COL_GS=global_scale.numel() != 1,
        BN=block_n,
        TILED=rows is not None,
    )
    return out
