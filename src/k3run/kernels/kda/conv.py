"""KDA's short causal conv on CUDA: prefill over a varlen batch, and one decode token per sequence with the
conv states kept in the cache pool.

`causal_conv1d_varlen_triton` (prefill) does in one launch what the torch reference does per sequence in
~4W + 4 full-size passes (concatenate the window, W fp32 multiply-adds, SiLU, transpose back): for token t of
sequence b (start s_b), channel c, with u_i = x[i, c] for i >= s_b and the initial state's entries before,

    y[t, c] = silu(sum_{j < W} w[c, j] * u_{t-W+1+j})     (fp32, j in order)

reading q | k | v in place from the projection output and writing the planar [G, T, C / G] layout. Its new
states (each sequence's last W-1 inputs) are gathered by index in torch, on the device.

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

from k3run.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _conv_varlen_kernel(
    x_ptr, stride_x, w_ptr, state_ptr, seq_ptr, cu_ptr, y_ptr, T, C, CG,
    HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = ts < T
    cmask = cs < C
    b = tl.load(seq_ptr + ts, mask=tmask, other=0)
    start = tl.load(cu_ptr + b, mask=tmask, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = ts - (W - 1) + j
        pos = src - start  # position in the sequence; negative: the initial state's entry pos + W - 1
        m = ((pos >= 0) & tmask)[:, None] & cmask[None, :]
        u = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cs[None, :], mask=m, other=0.0)
        u = u.to(tl.float32)
        if HAS_STATE:
            ms = ((pos < 0) & tmask)[:, None] & cmask[None, :]
            row = b.to(tl.int64)[:, None] * C * (W - 1) + cs[None, :] * (W - 1)
            u += tl.load(state_ptr + row + (pos + W - 1)[:, None], mask=ms, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cs * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += w[None, :] * u
    y = acc / (1.0 + tl.exp(-acc))
    g = cs // CG
    out = g.to(tl.int64)[None, :] * T * CG + ts.to(tl.int64)[:, None] * CG + (cs - g * CG)[None, :]
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


def varlen_final_states(
    x: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, W: int
) -> torch.Tensor:
    """Each sequence's last W-1 inputs [B, C, W-1] (oldest first), reaching into its initial state (or
    zeros) when it fed fewer than W-1 tokens: index arithmetic on the device, no host read."""
    T, C = x.shape
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    B = cu.numel() - 1
    starts, ends = cu[:-1, None], cu[1:, None]
    idx = ends - (W - 1) + torch.arange(W - 1, device=x.device)  # [B, W-1] token index of each entry
    from_x = (idx >= starts)[..., None]
    xs = x[idx.clamp(min=0, max=max(T - 1, 0))] if T else x.new_zeros(B, W - 1, C)  # [B, W-1, C]
    if initial_state is None:
        st = torch.zeros_like(xs)
    else:
        at = (idx - starts + (W - 1)).clamp(min=0, max=W - 2)  # entry of the initial state
        st = initial_state.to(x.dtype).transpose(1, 2).gather(1, at[..., None].expand(B, W - 1, C))
    return torch.where(from_x, xs, st).transpose(1, 2).contiguous()


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    groups: int = 1,
    block_t: int = 32,
    block_c: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (unit column stride, any row stride); weight [C, W]; cu_seqlens [B+1] on x's device;
    initial_state [B, C, W-1] or None (all fresh). Returns y [groups, T, C / groups] in x.dtype and the new
    states [B, C, W-1] in x.dtype."""
    T, C = x.shape
    W = weight.shape[1]
    B = cu_seqlens.numel() - 1
    if x.stride(1) != 1:
        raise ValueError(f"causal_conv1d (varlen): x needs unit column stride, got {x.stride()}")
    if C % groups:
        raise ValueError(f"causal_conv1d (varlen): {C} channels do not split into {groups} groups")
    if initial_state is not None and tuple(initial_state.shape) != (B, C, W - 1):
        raise ValueError(
            f"causal_conv1d (varlen): initial_state must be {(B, C, W - 1)}, got {tuple(initial_state.shape)}"
        )
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    y = torch.empty(groups, T, C // groups, dtype=x.dtype, device=x.device)
    state = initial_state.to(x.dtype).contiguous() if initial_state is not None else None
    if T:
        seq = torch.searchsorted(
            cu[1:], torch.arange(T, device=x.device, dtype=torch.int32), right=True, out_int32=True
        )
        grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
        _conv_varlen_kernel[grid](
            x, x.stride(0), weight.contiguous(), state if state is not None else x, seq, cu, y,
            T, C, C // groups, HAS_STATE=state is not None, W=W, BLOCK_T=block_t, BLOCK_C=block_c,
        )  # fmt: skip
    return y, varlen_final_states(x, cu_seqlens, state, W)


@triton.jit
def _conv_decode_kernel(
    x_ptr, stride_x, w_ptr, pool_ptr, stride_s0, slots_ptr, ctx_ptr, y_ptr, B, C, CG, rec_ptr, stride_r0,
    rec_elems, W: tl.constexpr, BLOCK_C: tl.constexpr, ZERO_REC: tl.constexpr, ZBLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0)
    if ZERO_REC:  # a fresh row's recurrent state (the next launch reads it) zeroed by the row's programs
        if tl.load(ctx_ptr + b) == 0:
            per = tl.cdiv(tl.cdiv(rec_elems, tl.num_programs(1)), ZBLOCK) * ZBLOCK
            lo = tl.program_id(1) * per
            row = rec_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_r0
            zero = tl.zeros([ZBLOCK], dtype=rec_ptr.dtype.element_ty)
            for o in range(lo, lo + per, ZBLOCK):
                offs = o + tl.arange(0, ZBLOCK)
                tl.store(row + offs, zero, mask=offs < rec_elems)
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
    zero_pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, C] (unit column stride); weight [C, W]; pool [S, C, W-1] in x's dtype; slots, context_lens [B].
    Returns y [groups, B, C / groups] in x.dtype; updates pool[slots] in place. zero_pool [S, ...] (rows
    contiguous): zero_pool[slots[i]] = 0 for every fresh row i (context_lens[i] == 0), in the same launch."""
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
    if zero_pool is not None and (zero_pool.dim() < 2 or not zero_pool[0].is_contiguous()):
        raise ValueError(
            f"causal_conv1d_decode_in_place: zero_pool must be [S, ...] with contiguous rows, got "
            f"{tuple(zero_pool.shape)}"
        )
    y = torch.empty(groups, B, C // groups, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    grid = (B, triton.cdiv(C, block_c))
    rec = zero_pool if zero_pool is not None else y
    _conv_decode_kernel[grid](
        x, x.stride(0), weight.contiguous(), pool, pool.stride(0), slots, context_lens, y, B, C, C // groups,
        rec, rec.stride(0), rec[0].numel(), W=W, BLOCK_C=block_c, ZERO_REC=zero_pool is not None, ZBLOCK=1024,
        **pdl_args(x),
    )  # fmt: skip
    return y
