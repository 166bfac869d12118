"""Grouped FP8_PB_WO experts: out[p] = x[p // x_div] @ dequant(W[e])^T for every pick p of an `expert_blocks`
table, one launch over all experts (no host synchronisation, so it sits in CUDA graphs).

W [E, N, K] e4m3 codes with fp32 128x128 block scales [E, ceil(N/128), ceil(K/128)] (each expert's rows
contiguous; the stacks may be views, such as the gate or up half of a [E, 2I, D] w13). Each program owns one
block of up to BM picks of one expert and BN output columns; per 128-column K chunk it decodes the codes
exactly to fp32 (bit arithmetic, no conversion instruction: the interpreter runs it too), multiplies by the
row's block scale, rounds to x's dtype (the weight `dequantize_fp8_block` gives) and accumulates the tensor-
core product in fp32; the output is rounded to x's dtype once. So each output is the reference's
`x @ dequantize_fp8_block(W[e], scale[e], x.dtype).T` up to the fp32 summation order.
`fp8_block_gemm_grouped_ref` is the fp32 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_BLOCK = 128
DEFAULT_CONFIG = (64, 4, 3)  # (BN, num_warps, num_stages)


@triton.jit
def _e4m3_to_f32(b):
    """uint8 e4m3fn codes -> exact fp32 values (0x7f / 0xff: NaN)."""
    b = b.to(tl.int32)
    ex = (b >> 3) & 15
    man = b & 7
    normal = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # man * 2^-9
    v = tl.where(ex == 0, sub, normal)
    v = tl.where((ex == 15) & (man == 7), float("nan"), v)
    return tl.where((b >> 7) != 0, -v, v)


@triton.jit
def _fp8_grouped_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, grp_ptr, N, K, stride_x, stride_out, x_div, NB_N, NB_K, stride_we,
    stride_se, BM: tl.constexpr, BN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    blk = pid // n_tiles
    e = tl.load(grp_ptr + blk * (BM + 1))
    if e < 0:  # a block past the last expert's
        return
    picks = tl.load(grp_ptr + blk * (BM + 1) + 1 + tl.arange(0, BM))  # -1 past the block's count
    valid = picks >= 0
    xrow = tl.where(valid, picks // x_div, 0).to(tl.int64)
    offs_n = (pid % n_tiles) * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_rows = s_ptr + e.to(tl.int64) * stride_se + (offs_n // 128) * NB_K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_ok = offs_k < K
        xt = tl.load(
            x_ptr + xrow[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        codes = tl.load(
            w_base + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
        )
        sc = tl.load(s_rows + k0 // 128, mask=n_ok, other=0.0)  # [BN]: each row's block scale
        wd = (_e4m3_to_f32(codes) * sc[:, None]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(xt, tl.trans(wd), acc, input_precision=DOT_PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + picks[:, None].to(tl.int64) * stride_out + offs_n[None, :], out,
             mask=valid[:, None] & n_ok[None, :])  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, grp: torch.Tensor, what: str) -> None:
    if weight.dim() != 3 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{what}: weight must be float8_e4m3fn [E, N, K], got {weight.dtype} {tuple(weight.shape)}"
        )
    e, n, k = weight.shape
    want = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale must be float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"{what}: x must be [T, {k}] with unit column stride, got {tuple(x.shape)}")
    if grp.dtype != torch.int32 or grp.dim() != 2 or not grp.is_contiguous():
        raise ValueError(f"{what}: grp must be a contiguous int32 table, got {grp.dtype} {tuple(grp.shape)}")
    if weight.stride()[1:] != (k, 1) or scale.stride()[1:] != (want[2], 1):
        raise ValueError(
            f"{what}: each expert's weight and scale must be contiguous (views of stacks are fine)"
        )


def fp8_block_gemm_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    grp: torch.Tensor,
    *,
    picks: int,
    x_div: int,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """out [picks, N] in x's dtype: row p = x[p // x_div] @ dequant(W[e])^T for every pick p in grp (the
    expert_blocks table; bm = its width - 1); rows of picks in no block keep what `out` held (zeros when
    out is None). config: (BN, num_warps, num_stages)."""
    what = "fp8 grouped gemm"
    _check(x, weight, scale, grp, what)
    _, n, k = weight.shape
    if out is None:
        out = torch.zeros((picks, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (picks, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{what}: out must be {x.dtype} [{picks}, {n}], got {out.dtype} {tuple(out.shape)}")
    if picks == 0 or grp.shape[0] == 0:
        return out
    bm = grp.shape[1] - 1
    bn, warps, stages = config or DEFAULT_CONFIG
    grid = (grp.shape[0] * triton.cdiv(n, bn),)
    _fp8_grouped_kernel[grid](
        x, weight.view(torch.uint8), scale, out, grp, n, k, x.stride(0), out.stride(0), x_div,
        scale.shape[1], scale.shape[2], weight.stride(0), scale.stride(0), BM=bm, BN=bn,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fp8_block_gemm_grouped_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, x_div: int
) -> torch.Tensor:
    """fp32 reference: row p = x[p // x_div] @ dequantize_fp8_block(W[ids[p]], scale[ids[p]])^T for picks
    with a local expert id, zero rows for the others."""
    from k3run.formats import dequantize_fp8_block

    e = weight.shape[0]
    out = torch.zeros(ids.shape[0], weight.shape[1], dtype=torch.float32)
    for p, eid in enumerate(ids.tolist()):
        if 0 <= eid < e:
            w = dequantize_fp8_block(weight[eid].cpu(), scale[eid].cpu(), torch.float32)
            out[p] = x[p // x_div].float().cpu() @ w.t()
    return out
