"""Absorbed MLA decode attention as a split-context (flash-decoding) Triton kernel.

Program (b, split, head block): the positions [split * chunk, min((split + 1) * chunk, context_lens[b] + 1))
of slot slots[b], read straight from the latent cache in its own dtype (no gathered window, no fp32 copy):
scores = q_lat . c + q_pe . k_pe on the tensor cores (queries and probabilities rounded to the cache dtype),
an online softmax in fp32, and the weighted latents; splits past a sequence's length return at once. A
second step (torch, a few tiny launches) merges the splits by their log-sum-exp. The grid depends only on
(B, window), so a CUDA graph can hold it while the real lengths vary.

Versus the fp32 reference: the queries and probabilities are rounded to the cache dtype once before the
dots (bf16: 2^-9 relative), so outputs differ by ~1e-3 relative RMS for bf16 caches; fp32 caches compute in
fp32 (exact dots in the interpreter; tf32-free `ieee` precision on GPUs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, store_ptr, slots_ptr, ctx_ptr, o_ptr, lse_ptr, H, SPLITS, chunk, stride_slot, stride_pos, scale,
    L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n_ctx = tl.load(ctx_ptr + b) + 1  # positions 0 .. context_lens[b]
    start = sp * chunk
    end = tl.minimum(start + chunk, n_ctx)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    cl = tl.arange(0, L)
    cr = tl.arange(0, R)
    q_rows = q_ptr + (b * H + heads).to(tl.int64)[:, None] * (L + R)
    dt = store_ptr.dtype.element_ty
    q_c = tl.load(q_rows + cl[None, :], mask=hmask[:, None], other=0.0).to(dt)  # [BH, L]
    q_r = tl.load(q_rows + L + cr[None, :], mask=hmask[:, None], other=0.0).to(dt)  # [BH, R]
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    base = store_ptr + slot * stride_slot
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        rows = base + pos.to(tl.int64)[:, None] * stride_pos
        c = tl.load(rows + cl[None, :], mask=pmask[:, None], other=0.0)  # [BN, L]
        kr = tl.load(rows + L + cr[None, :], mask=pmask[:, None], other=0.0)  # [BN, R]
        if IEEE:
            s = tl.dot(q_c, tl.trans(c), input_precision="ieee") + tl.dot(
                q_r, tl.trans(kr), input_precision="ieee"
            )
        else:
            s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_r, tl.trans(kr))
        s = tl.where(pmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(dt), c)
        m = m_new
    empty = s_sum == 0.0  # a split past the sequence's end
    o = acc / tl.where(empty, 1.0, s_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s_sum)))
    part = (b * SPLITS + sp) * H + heads
    tl.store(o_ptr + part.to(tl.int64)[:, None] * L + cl[None, :], o, mask=hmask[:, None])
    tl.store(lse_ptr + part, lse, mask=hmask)


def choose_splits(batch: int, window: int, head_blocks: int, sms: int = 132, min_chunk: int = 64) -> int:
    """Splits of the window so that batch x splits x head blocks fills ~2 programs per SM, with at least
    `min_chunk` positions per split."""
    want = max(1, -(-2 * sms // max(1, batch * head_blocks)))
    return max(1, min(want, -(-window // min_chunk)))


def mla_decode_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    scale: float,
    *,
    splits: int | None = None,
    block_h: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """mla_decode_ref's contract (o_lat [B, H, L] fp32) without the window's copies."""
    B, H, L = q_lat.shape
    R = q_pe.shape[-1]
    if store.dim() != 3 or store.shape[2] != L + R or window > store.shape[1]:
        raise ValueError(f"mla_decode: store must be [S, >= {window}, {L + R}], got {tuple(store.shape)}")
    if store.stride(2) != 1:
        raise ValueError(f"mla_decode: store needs a unit last stride, got {store.stride()}")
    if L & (L - 1) or R & (R - 1):
        raise ValueError(f"mla_decode: L = {L} and R = {R} must be powers of two")
    q = torch.cat([q_lat, q_pe], dim=-1).float().contiguous()  # [B, H, L + R]
    head_blocks = triton.cdiv(H, block_h)
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = choose_splits(B, window, head_blocks, sms)
    chunk = triton.cdiv(window, splits)
    o = torch.empty(B, splits, H, L, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, splits, H, dtype=torch.float32, device=q.device)
    _mla_decode_split_kernel[(B, splits, head_blocks)](
        q, store, slots, context_lens, o, lse, H, splits, chunk, store.stride(0), store.stride(1), scale,
        L=L, R=R, BLOCK_H=block_h, BLOCK_N=block_n, IEEE=store.dtype == torch.float32,
        num_warps=8 if L >= 256 else 4,
    )  # fmt: skip
    w = torch.softmax(lse, dim=1)  # [B, splits, H]: empty splits weigh 0
    return (w.unsqueeze(-1) * o).sum(1)
