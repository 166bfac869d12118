"""Triton kernels of kernels/sampling (CUDA): inverse-CDF sampling of a batch's rows in three launches over
column chunks. The torch reference is ref.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.moe_ops.triton import LIBDEVICE, _exp
from k3run.kernels.pdl import pdl_args, pdl_enter

CHUNK = 4096  # columns a program: K3's 163840-token vocabulary in 40 programs a row


@triton.jit
def _scaled_chunk(x_ptr, spec_ptr, i, c, V, sx, SCALED: tl.constexpr, C: tl.constexpr):
    # row i's columns c*C .. of s = logits[r] / temperature (fp32 division, as torch's), or of the given
    # scaled rows; -inf past V (weight 0)
    cols = c * C + tl.arange(0, C)
    ok = cols < V
    if SCALED:
        return tl.load(x_ptr + i.to(tl.int64) * sx + cols, mask=ok, other=float("-inf")), cols
    r = tl.load(spec_ptr + i * 5).to(tl.int64)
    t = tl.load(spec_ptr + i * 5 + 1).to(tl.float32)
    x = tl.load(x_ptr + r * sx + cols, mask=ok, other=float("-inf"))
    return tl.where(ok, tl.div_rn(x, t), float("-inf")), cols


@triton.jit
def _row_max(m_ptr, i, NC, BLOCK_NC: tl.constexpr):
    cc = tl.arange(0, BLOCK_NC)
    return tl.max(tl.load(m_ptr + i * NC + cc, mask=cc < NC, other=float("-inf")), axis=0)


@triton.jit
def _chunk_max_kernel(
    x_ptr, spec_ptr, m_ptr, V, sx, NC, SCALED: tl.constexpr, C: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    # program (row i, chunk c): the chunk's largest s
    pdl_enter(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1)
    s, _ = _scaled_chunk(x_ptr, spec_ptr, i, c, V, sx, SCALED, C)
    tl.store(m_ptr + i * NC + c, tl.max(s, axis=0))


@triton.jit
def _chunk_sum_kernel(
    x_ptr, spec_ptr, m_ptr, sum_ptr, V, sx, NC, SCALED: tl.constexpr, C: tl.constexpr,
    BLOCK_NC: tl.constexpr, LIB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # program (row i, chunk c): the chunk's weights summed in float64
    pdl_enter(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1)
    m = _row_max(m_ptr, i, NC, BLOCK_NC)
    s, _ = _scaled_chunk(x_ptr, spec_ptr, i, c, V, sx, SCALED, C)
    w = _exp(s - m, LIB)  # exp(s - max) in fp32: libdevice's on the GPU, as torch's exp
    tl.store(sum_ptr + i * NC + c, tl.sum(w.to(tl.float64), axis=0))


@triton.jit
def _pick_kernel(
    x_ptr, spec_ptr, m_ptr, sum_ptr, out_ptr, V, sx, NC, SCALED: tl.constexpr, C: tl.constexpr,
    BLOCK_NC: tl.constexpr, LIB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # program i: target = u x the row's total; the chunk where the inclusive prefix of the chunk sums first
    # exceeds it; there, the first column whose inclusive cumulative weight (float64) exceeds it; past the
    # last column (rounding), the last column. Written to out[r].
    pdl_enter(PDL)
    i = tl.program_id(0)
    cc = tl.arange(0, BLOCK_NC)
    sums = tl.load(sum_ptr + i * NC + cc, mask=cc < NC, other=0.0)
    pre = tl.cumsum(sums, axis=0)  # inclusive, float64; chunks past NC repeat the total
    total = tl.sum(tl.where(cc == NC - 1, pre, 0.0), axis=0)
    u = tl.load(spec_ptr + i * 5 + 4)
    target = u * total
    j = tl.sum((pre <= target).to(tl.int32), axis=0)  # the first chunk whose prefix exceeds the target
    tok = V - 1
    if j < NC:
        before = tl.sum(tl.where(cc == j - 1, pre, 0.0), axis=0)  # 0 for j = 0
        m = _row_max(m_ptr, i, NC, BLOCK_NC)
        s, cols = _scaled_chunk(x_ptr, spec_ptr, i, j, V, sx, SCALED, C)
        cw = before + tl.cumsum(_exp(s - m, LIB).to(tl.float64), axis=0)
        tok = tl.minimum(j * C + tl.sum((cw <= target).to(tl.int32), axis=0), V - 1)
    r = tl.load(spec_ptr + i * 5).to(tl.int64)
    tl.store(out_ptr + r, tok.to(tl.int64))


def sample_inverse_cdf_triton(
    logits: torch.Tensor, spec: torch.Tensor, out: torch.Tensor, scaled: bool = False, chunk: int = CHUNK
) -> torch.Tensor:
    """`sample_inverse_cdf_ref` in three launches: each chunk's largest s, each chunk's float64 weight sum
    (after the row's largest), then per row the chunk and the column where the cumulative weight passes
    u x total. logits fp32 [B, V] (or the [B', V] scaled rows), unit column stride; spec float64 [B', 5]
    contiguous; out int64 [B]. `chunk`: columns a program (a power of two; small ones for the tests)."""
    rows = spec.shape[0]
    v = logits.shape[1]
    if rows == 0:
        return out
    if logits.dtype != torch.float32 or logits.stride(1) != 1 or spec.dtype != torch.float64:
        raise ValueError(
            f"sample_inverse_cdf: expected fp32 logits with unit column stride and a float64 spec, got "
            f"{logits.dtype} strides {tuple(logits.stride())}, spec {spec.dtype}"
        )
    spec = spec.contiguous()
    nc = triton.cdiv(v, chunk)
    maxes = torch.empty(rows, nc, dtype=torch.float32, device=logits.device)
    sums = torch.empty(rows, nc, dtype=torch.float64, device=logits.device)
    common = dict(SCALED=scaled, C=chunk, num_warps=8, **pdl_args(logits))
    block_nc = triton.next_power_of_2(nc)
    _chunk_max_kernel[(rows, nc)](logits, spec, maxes, v, logits.stride(0), nc, **common)
    _chunk_sum_kernel[(rows, nc)](
        logits, spec, maxes, sums, v, logits.stride(0), nc, BLOCK_NC=block_nc, LIB=LIBDEVICE, **common
    )
    _pick_kernel[(rows,)](
        logits, spec, maxes, sums, out, v, logits.stride(0), nc, BLOCK_NC=block_nc, LIB=LIBDEVICE, **common
    )
    return out
