"""KDA's short causal conv for one decode token per sequence, with the conv states kept in the cache pool.

`causal_conv1d_decode_in_place_triton` does in one launch what the batched torch decode does in ~20 (gather
the states, mask the fresh rows, concatenate the window, W multiply-adds, SiLU, scatter the states back):
for row b and channel c, with s = pool[slots[b], c, :] (zeros when context_lens[b] == 0) and x = x[b, c],

    y[b, c]              = silu(sum_{j < W-1} w[c, j] * s[j] + w[c, W-1] * x)     (fp32, j in order)
    pool[slots[b], c, :] = (s[1], ..., s[W-2], x)

x may be a column slice of a wider projection output (any row stride), so q | k | v need no concatenation.
The output is planar, [G, B, C / G] with G = `groups` (3: q, k, v), so each group is a contiguous [B, C/G]
tensor for the recurrence kernel. The torch reference is causal_conv1d_decode_ref plus the gather/scatter
(`kernels.kda.causal_conv1d_decode_in_place` on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_decode_kernel(
    x_ptr, stride_x, w_ptr, pool_ptr, stride_s0, slots_ptr, ctx_ptr, y_ptr, B, C, CG,
    W: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cs < C
    # a fresh row (context 0) starts from a zero window (the flag broadcast to a vector mask)
    old = mask & ((cs * 0 + tl.load(ctx_ptr + b)) != 0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + cs, mask=mask, other=0.0)
    state = pool_ptr + slot * stride_s0 + cs * (W - 1)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(state + j, mask=old, other=0.0)
        w = tl.load(w_ptr + cs * W + j, mask=mask, other=0.0).to(tl.float32)
        acc += w * s.to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1), s, mask=mask)  # shift the window left
    w_last = tl.load(w_ptr + cs * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    acc += w_last * x.to(tl.float32)
    tl.store(state + (W - 2), x.to(pool_ptr.dtype.element_ty), mask=mask)
    y = acc / (1.0 + tl.exp(-acc))
    g = cs // CG
    tl.store(
        y_ptr + g.to(tl.int64) * B * CG + b * CG + (cs - g * CG), y.to(y_ptr.dtype.element_ty), mask=mask
    )


def causal_conv1d_decode_in_place_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    groups: int = 1,
    block_c: int = 512,
) -> torch.Tensor:
    """x [B, C] (unit column stride); weight [C, W]; pool [S, C, W-1] in x's dtype; slots, context_lens [B].
    Returns y [groups, B, C / groups] in x.dtype; updates pool[slots] in place."""
    B, C = x.shape
    W = weight.shape[1]
    if x.stride(1) != 1:
        raise ValueError(f"causal_conv1d_decode_in_place: x needs unit column stride, got {x.stride()}")
    if tuple(pool.shape[1:]) != (C, W - 1) or not pool[0].is_contiguous() or pool.dtype != x.dtype:
        raise ValueError(
            f"causal_conv1d_decode_in_place: pool must be [S, {C}, {W - 1}] {x.dtype} with contiguous rows, "
            f"got {tuple(pool.shape)} {pool.dtype}"
        )
    if C % groups:
        raise ValueError(f"causal_conv1d_decode_in_place: {C} channels do not split into {groups} groups")
    y = torch.empty(groups, B, C // groups, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    grid = (B, triton.cdiv(C, block_c))
    _conv_decode_kernel[grid](
        x, x.stride(0), weight.contiguous(), pool, pool.stride(0), slots, context_lens, y, B, C, C // groups,
        W=W, BLOCK_C=block_c,
    )  # fmt: skip
    return y
