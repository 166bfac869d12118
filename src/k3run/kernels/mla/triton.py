"""Absorbed MLA decode attention as a split-context (flash-decoding) Triton kernel.

Program (b, split, head block): the positions [split * chunk, min((split + 1) * chunk, context_lens[b] + 1))
of slot slots[b], read straight from the latent cache in its own dtype (no gathered window, no fp32 copy):
scores = q_lat . c + q_pe . k_pe on the tensor cores (queries and probabilities rounded to the cache dtype),
an online softmax in fp32, and the weighted latents; splits past a sequence's length return at once. A
second launch merges the splits by their log-sum-exp, many splits a step (`_mla_merge_kernel`). The grids
depend only on (B, window), so a CUDA graph can hold them while the real lengths vary. Large steps
(`shares_splits`; K3RUN_MLA_SHARED_SPLITS forces either way) lay the splits out by length instead
(`_mla_decode_shared_kernel`): a long sequence among short ones takes most of the programs.

Versus the fp32 reference: the queries and probabilities are rounded to the cache dtype once before the
dots (bf16: 2^-9 relative), so outputs differ by ~1e-3 relative RMS for bf16 caches; fp32 caches compute in
fp32 (exact dots in the interpreter; tf32-free `ieee` precision on GPUs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.kernels.pdl import pdl_args, pdl_enter
from k3run.kernels.tc_split import TENSOR_CORES, dot_split, dot_split2, split3
from k3run.knobs import knobs

# the fewest sequences the absorb kernels' tensor-core forms take by default; below, one sequence at a time
# (the loop forms). On an H100 (bench_mla_decode, the q + o pair) the two are level at 8 sequences and the
# loops' time doubles with the sequences while the dot forms' barely moves to 16
ABSORB_DOT_FROM = 9
# the o dot form takes 32-sequence blocks above this many (sequence, head) pairs, else 16. On an H200 (us for
# the q + o pair): at 64 sequences 26.2 against 39.0 (32 heads), at 32 and 64 sequences of 96 heads 47.9 /
# 76.4 against 62.8 / 112.9; at 32 sequences of 32 heads 16 is as fast (22.9 against 24.5)
O_BLOCK32_FROM = 1024
# the merge: programs take MERGE_COLS latent columns where (sequence, head) pairs are few (<= MERGE_PAIRS:
# one sequence or a few, whose many splits a program alone would walk slowly), else a whole row; a step
# loads MERGE_TILE elements (MERGE_SPLITS splits of 128 columns, 8 of 512). On an H100 (bench/RESULTS.md)
# the narrow programs gained at 1-8 sequences of 32 heads and lost up to 1.35x at 32 x 96 pairs
MERGE_COLS = 128
MERGE_PAIRS = 512
MERGE_TILE = 4096
MERGE_SPLITS = MERGE_TILE // MERGE_COLS
# `shared` launches (`shares_splits`): the programs a head block's pieces share, per
# SM. Two, not decode_config's per_sm of 4 from 8 sequences: that 4 was tuned on contexts filling half of
# their window, so it meant ~2 live programs an SM, and 4 live ones were 1.3-1.5x slower (H100, 8-32
# sequences of 8K-32K, bench/RESULTS.md)
SHARED_PER_SM = 2
# the heads a decode program attends (decode_config's block_h; K3's 96 heads are 3 blocks)
BLOCK_HEADS = 32


@triton.jit
def _shares(ctx_ptr, B, window, TOTAL, min_chunk, key, BY_PROGRAM: tl.constexpr):
    """The shared-splits layout (`shared` launches): sequence b of n_b = min(context_lens[b] + 1, window)
    positions takes s_b = max(1, min(TOTAL * n_b // sum n, cdiv(n_b, min_chunk))) pieces, as partial rows
    [first_b, first_b + s_b) in sequence order, so the pieces of all sequences number <= TOTAL + B and the
    grid's spare programs sit at its end. Returns (sequence, first_b, s_b, n_b) of the sequence that holds
    program `key` (BY_PROGRAM; sequence -1 where none does) or of sequence `key`."""
    total = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, B, 64):
        bs = b0 + tl.arange(0, 64)
        n = tl.load(ctx_ptr + bs, mask=bs < B, other=-1).to(tl.int64) + 1
        total += tl.sum(tl.minimum(tl.maximum(n, 0), window), axis=0)
    run = tl.zeros([], dtype=tl.int64)
    seq = tl.full([], -1, dtype=tl.int64)
    first = tl.zeros([], dtype=tl.int64)
    count = tl.zeros([], dtype=tl.int64)
    n_of = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, B, 64):
        bs = b0 + tl.arange(0, 64)
        live = bs < B
        n = tl.minimum(tl.maximum(tl.load(ctx_ptr + bs, mask=live, other=-1).to(tl.int64) + 1, 0), window)
        s = tl.maximum(tl.minimum(TOTAL * n // tl.maximum(total, 1), tl.cdiv(n, min_chunk)), 1)
        s = tl.where(live, s, 0)
        incl = tl.cumsum(s, axis=0) + run
        excl = incl - s
        if BY_PROGRAM:
            hit = live & (excl <= key) & (key < incl)
        else:
            hit = bs == key
        seq = tl.maximum(seq, tl.max(tl.where(hit, bs.to(tl.int64), -1), axis=0))
        first += tl.sum(tl.where(hit, excl, 0), axis=0)
        count += tl.sum(tl.where(hit, s, 0), axis=0)
        n_of += tl.sum(tl.where(hit, n, 0), axis=0)
        run += tl.sum(s, axis=0)
    return seq, first, count, n_of


@triton.jit
def _attend(
    q_ptr, store_ptr, o_ptr, lse_ptr, H, stride_slot, stride_pos, scale, b, slot, start, end, row, hb,
    L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One split program's work: positions [start, end) of sequence b (cache slot `slot`) for head block hb,
    its partials at row `row`."""
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
        rows = base + pos[:, None] * stride_pos  # int32 offsets: the wrapper checks window * stride < 2^31
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
    # a split past the sequence's end writes only lse = -inf: the merge never reads its o
    empty = s_sum == 0.0
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s_sum)))
    part = row * H + heads
    tl.store(lse_ptr + part, lse, mask=hmask)
    if start < end:
        o = acc / tl.where(empty, 1.0, s_sum)[:, None]
        tl.store(o_ptr + part.to(tl.int64)[:, None] * L + cl[None, :], o, mask=hmask[:, None])


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, store_ptr, slots_ptr, ctx_ptr, o_ptr, lse_ptr, H, SPLITS, chunk, window, stride_slot, stride_pos,
    scale, L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (b, split, head block): positions [split * chunk, (split + 1) * chunk) of sequence b, its
    partials at row b * SPLITS + split."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    sp = tl.program_id(1)
    hb = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    # positions 0 .. context_lens[b], never past the window (a corrupt length must not read out of bounds)
    n_ctx = tl.minimum(tl.load(ctx_ptr + b) + 1, window)
    start = sp * chunk
    end = tl.minimum(start + chunk, n_ctx)
    _attend(q_ptr, store_ptr, o_ptr, lse_ptr, H, stride_slot, stride_pos, scale, b, slot, start, end,
            b * SPLITS + sp, hb, L, R, BLOCK_H, BLOCK_N, IEEE)  # fmt: skip


@triton.jit
def _mla_decode_shared_kernel(
    q_ptr, store_ptr, slots_ptr, ctx_ptr, o_ptr, lse_ptr, H, B, TOTAL, min_chunk, window, stride_slot,
    stride_pos, scale, L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (i, 0, head block): piece i of `_shares`' layout (a sequence's pieces even), its partials at
    row i; a program past every sequence's pieces writes only lse = -inf at its row, which no merge reads."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    seq, first, count, n_all = _shares(ctx_ptr, B, window, TOTAL, min_chunk, row, True)
    b = tl.maximum(seq, 0).to(tl.int32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    piece = tl.cdiv(n_all, tl.maximum(count, 1)).to(tl.int32)
    start = (row - first).to(tl.int32) * piece
    end = tl.where(seq >= 0, tl.minimum(start + piece, n_all.to(tl.int32)), start)
    _attend(q_ptr, store_ptr, o_ptr, lse_ptr, H, stride_slot, stride_pos, scale, b, slot, start, end, row,
            tl.program_id(2), L, R, BLOCK_H, BLOCK_N, IEEE)  # fmt: skip


@triton.jit
def _mla_merge_kernel(
    o_ptr, lse_ptr, out_ptr, ctx_ptr, H, B, SPLITS, TOTAL, min_chunk, window, L: tl.constexpr,
    BLOCK_S: tl.constexpr, BS: tl.constexpr, BL: tl.constexpr, SHARED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (b, h, block of BL latent columns): out[b, h, cols] = sum over splits s of softmax_s(lse[b, s,
    h]) * o[b, s, h, cols]. The splits go BS at a time as one [BS, BL] tile, so a program waits on one
    round trip per BS splits, not one per split; splits with lse = -inf (empty) weigh 0 and their o (never
    written) is not read. Sequence b's splits are partial rows b * SPLITS + s, or (SHARED) its rows of
    `_shares`' layout."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    cl = tl.program_id(2) * BL + tl.arange(0, BL)
    if SHARED:
        _, first, count, _ = _shares(ctx_ptr, B, window, TOTAL, min_chunk, b, False)
        row0 = first.to(tl.int32)
        n_splits = count.to(tl.int32)
    else:
        row0 = b * SPLITS
        n_splits = SPLITS
    ss = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_ptr + (row0 + ss) * H + h, mask=ss < n_splits, other=float("-inf"))
    top = tl.max(lse_all, axis=0)
    total = tl.sum(tl.exp(lse_all - top), axis=0)
    acc = tl.zeros([BL], dtype=tl.float32)
    for s0 in range(0, n_splits, BS):
        sp = s0 + tl.arange(0, BS)
        lse = tl.load(lse_ptr + (row0 + sp) * H + h, mask=sp < n_splits, other=float("-inf"))
        w = tl.exp(lse - top)
        rows = o_ptr + ((row0 + sp) * H + h).to(tl.int64)[:, None] * L + cl[None, :]
        o = tl.load(rows, mask=(w > 0.0)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    tl.store(out_ptr + (b * H + h).to(tl.int64) * L + cl, acc / total)


@triton.jit
def _w_uk_tile(w_ptr, h, lb, DN: tl.constexpr, L: tl.constexpr, BLOCK_DN: tl.constexpr, BL: tl.constexpr):
    # a q absorb program's W_UK[h, :, block lb] tile [BLOCK_DN, BL] fp32 (rows past DN zero), with its indices
    d = tl.arange(0, BLOCK_DN)
    dm = d < DN
    cl = lb * BL + tl.arange(0, BL)
    w = tl.load(w_ptr + (h * DN + d).to(tl.int64)[:, None] * L + cl[None, :], mask=dm[:, None], other=0.0)
    return d, dm, cl, w


@triton.jit
def _mla_q_absorb_kernel(
    q_ptr, w_ptr, out_ptr, B, H, sqb, sqh, DN: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    BLOCK_DN: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr = False, AHEAD: tl.constexpr = True,
):  # fmt: skip
    """Program (head h, latent block): out[b, h, block] = q[b, h, :DN] . W_UK[h, :, block] in fp32 for every
    b, and (block 0's program) out[b, h, L:] = q[b, h, DN:] in fp32: the decode kernel's [B, H, L + R]
    queries in one launch. W_UK is a parameter: its tile loads before the PDL wait. With AHEAD each
    sequence's q row is loaded while the previous one's product is formed and stored (without, each
    sequence waits for its own load: one L2 round trip each)."""
    h = tl.program_id(0)
    lb = tl.program_id(1)
    d, dm, cl, w = _w_uk_tile(w_ptr, h, lb, DN, L, BLOCK_DN, BL)
    pdl_enter(PDL)
    cr = tl.arange(0, R)
    rope = cr + lb * R < R  # only block 0's programs copy the RoPE part
    if AHEAD:  # (the launcher runs no program for B = 0, so row 0 exists)
        qn_next = tl.load(q_ptr + h * sqh + d, mask=dm, other=0.0)
        qr_next = tl.load(q_ptr + h * sqh + DN + cr)
    for b in range(0, B):
        q_row = q_ptr + b * sqb + h * sqh
        if AHEAD:
            qn = qn_next.to(tl.float32)
            qr = qr_next
            nxt = q_ptr + tl.minimum(b + 1, B - 1) * sqb + h * sqh  # the last sequence re-reads its own row
            qn_next = tl.load(nxt + d, mask=dm, other=0.0)
            qr_next = tl.load(nxt + DN + cr)
        else:
            qn = tl.load(q_row + d, mask=dm, other=0.0).to(tl.float32)
            qr = tl.load(q_row + DN + cr)
        out_row = out_ptr + (b * H + h) * (L + R)
        ot = out_ptr.dtype.element_ty
        tl.store(out_row + cl, tl.sum(qn[:, None] * w, axis=0).to(ot))
        tl.store(out_row + L + cr, qr.to(tl.float32).to(ot), mask=rope)


@triton.jit
def _mla_o_absorb_kernel(
    o_ptr, w_ptr, out_ptr, B, H, DV: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
    PDL: tl.constexpr = False, AHEAD: tl.constexpr = True,
):  # fmt: skip
    """Program (head h, block of BV output columns): out[b, h, v] = o_lat[b, h, :] . W_UV[h, v, :] in fp32,
    rounded once to out's dtype, for every b. W_UV's tile loads before the PDL wait. With AHEAD the next
    sequence's latent row loads while this one's sum is formed and stored."""
    h = tl.program_id(0)
    v = tl.program_id(1) * BV + tl.arange(0, BV)
    vm = v < DV
    cl = tl.arange(0, L)
    w = tl.load(w_ptr + (h * DV + v).to(tl.int64)[:, None] * L + cl[None, :], mask=vm[:, None], other=0.0)
    pdl_enter(PDL)
    if AHEAD:  # (the launcher runs no program for B = 0, so row 0 exists)
        ol_next = tl.load(o_ptr + h * L + cl)
    for b in range(0, B):
        if AHEAD:
            ol = ol_next
            # (the last sequence re-reads its own row)
            ol_next = tl.load(o_ptr + (tl.minimum(b + 1, B - 1) * H + h) * L + cl)
        else:
            ol = tl.load(o_ptr + (b * H + h) * L + cl)
        acc = tl.sum(w * ol[None, :], axis=1)
        tl.store(out_ptr + (b * H + h) * DV + v, acc.to(out_ptr.dtype.element_ty), mask=vm)


@triton.jit
def _mla_q_absorb_dot_kernel(
    q_ptr, w_ptr, out_ptr, B, H, sqb, sqh, DN: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    BLOCK_DN: tl.constexpr, BL: tl.constexpr, BB: tl.constexpr, QSPLIT: tl.constexpr, TC: tl.constexpr = True,
    PDL: tl.constexpr = False, FMA: tl.constexpr = False,
):  # fmt: skip
    """`_mla_q_absorb_kernel`'s sums with BB sequences at a time on the tensor cores: W_UK's tile as three
    exact bf16 parts (tc_split), split before the PDL wait; q as it is where bf16, else split too (QSPLIT,
    nine dots). Every product is exact, so each sum is the fp32 sum of the same products in another order.
    FMA: one fp32 `ieee` dot instead (fused multiply-adds on the CUDA cores: no parts, the same exactness;
    2-8x slower than the other forms on an H100, bench/RESULTS.md: only K3RUN_MLA_ABSORB_FMA takes it)."""
    h = tl.program_id(0)
    lb = tl.program_id(1)
    d, dm, cl, w = _w_uk_tile(w_ptr, h, lb, DN, L, BLOCK_DN, BL)
    if not FMA:
        w_hi, w_mid, w_lo = split3(w)  # [BLOCK_DN, BL] each
    pdl_enter(PDL)
    bb = tl.arange(0, BB)
    cr = tl.arange(0, R)
    rope = (cr + lb * R < R)[None, :]  # only block 0's programs copy the RoPE part
    for b0 in range(0, B, BB):
        b = b0 + bb
        bm = (b < B)[:, None]
        rows = q_ptr + b.to(tl.int64)[:, None] * sqb + h * sqh
        qn = tl.load(rows + d[None, :], mask=bm & dm[None, :], other=0.0)  # [BB, BLOCK_DN]
        acc = tl.zeros([BB, BL], tl.float32)
        if FMA:
            acc = tl.dot(qn.to(tl.float32), w, acc, input_precision="ieee")
        elif QSPLIT:
            acc = dot_split2(qn.to(tl.float32), w_hi, w_mid, w_lo, acc, TC)
        else:
            acc = dot_split(qn, w_hi, w_mid, w_lo, acc, TC)
        out_rows = out_ptr + (b.to(tl.int64) * H + h)[:, None] * (L + R)
        ot = out_ptr.dtype.element_ty
        tl.store(out_rows + cl[None, :], acc.to(ot), mask=bm)
        qr = tl.load(rows + DN + cr[None, :], mask=bm & rope, other=0.0)
        tl.store(out_rows + L + cr[None, :], qr.to(tl.float32).to(ot), mask=bm & rope)


@triton.jit
def _mla_o_absorb_dot_kernel(
    o_ptr, w_ptr, out_ptr, B, H, DV: tl.constexpr, L: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BB: tl.constexpr, TC: tl.constexpr = True, PDL: tl.constexpr = False, FMA: tl.constexpr = False,
):  # fmt: skip
    """`_mla_o_absorb_kernel`'s sums for BB sequences (the grid's third axis) on the tensor cores, BK latent
    columns a step: o_lat's and W_UV's fp32 tiles each as three exact bf16 parts (tc_split, nine dots), so
    each sum is the fp32 sum of the same exact products in another order, rounded once to out's dtype. W_UV's
    first tile loads before the PDL wait; each step loads the next step's tiles before its own dots. FMA: one
    fp32 `ieee` dot a step instead (fused multiply-adds on the CUDA cores)."""
    h = tl.program_id(0)
    v = tl.program_id(1) * BV + tl.arange(0, BV)
    vm = (v < DV)[None, :]
    k = tl.arange(0, BK)
    w_cols = w_ptr + (h * DV + v).to(tl.int64)[None, :] * L  # W_UV[h, v, :] as the columns of a [BK, BV] tile
    wn = tl.load(w_cols + k[:, None], mask=vm, other=0.0)
    pdl_enter(PDL)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    bm = (b < B)[:, None]
    o_rows = o_ptr + (b.to(tl.int64) * H + h)[:, None] * L
    on = tl.load(o_rows + k[None, :], mask=bm, other=0.0)
    acc = tl.zeros([BB, BV], tl.float32)
    for k0 in range(0, L, BK):
        wc = wn
        oc = on
        kn = k0 + BK + k  # the next step's tiles (none after the last: masked, nothing read)
        more = kn < L
        wn = tl.load(w_cols + kn[:, None], mask=vm & more[:, None], other=0.0)
        on = tl.load(o_rows + kn[None, :], mask=bm & more[None, :], other=0.0)
        if FMA:
            acc = tl.dot(oc, wc, acc, input_precision="ieee")
        else:
            w_hi, w_mid, w_lo = split3(wc)
            acc = dot_split2(oc, w_hi, w_mid, w_lo, acc, TC)
    out = out_ptr + (b.to(tl.int64) * H + h)[:, None] * DV + v[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=bm & vm)


@triton.jit
def _mla_latent_store_kernel(
    kv_ptr, w_ptr, store_ptr, slots_ptr, pos_ptr, sk, stride_slot, stride_pos, max_len, eps, L: tl.constexpr,
    R: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program b: the latent of row b of kv_a [B, L + R] (the first L columns RMS-normalised with w, in fp32
    and rounded to kv_a's dtype as the norm kernel does; the RoPE columns as they are) stored in the cache's
    dtype at position pos[b] of slot slots[b]. A position past the cache is not written (a corrupt length
    must not write out of bounds)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    cl = tl.arange(0, L)
    cr = tl.arange(0, R)
    row = kv_ptr + b.to(tl.int64) * sk
    x = tl.load(row + cl).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
    y = (x * r * tl.load(w_ptr + cl).to(tl.float32)).to(kv_ptr.dtype.element_ty)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    dst = store_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_slot + pos * stride_pos
    dt = store_ptr.dtype.element_ty
    tl.store(dst + cl, y.to(dt), mask=(cl * 0 + pos) < max_len)
    tl.store(dst + L + cr, tl.load(row + L + cr).to(dt), mask=(cr * 0 + pos) < max_len)


def mla_latent_store_triton(
    kv_a: torch.Tensor, weight: torch.Tensor, eps: float, store: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:  # fmt: skip
    """mla_latent_store_ref in one launch: kv_a [B, L + R] (unit last stride), the norm's weight [L], the
    cache store [S, N, L + R] (unit last stride), slots and positions [B]; L and R powers of two."""
    B, LR = kv_a.shape
    L = weight.shape[0]
    R = LR - L
    if (
        store.dim() != 3 or store.shape[2] != LR or store.stride(2) != 1 or kv_a.stride(1) != 1 or R < 1
        or L & (L - 1) or R & (R - 1) or slots.shape != (B,) or positions.shape != (B,)
    ):  # fmt: skip
        raise ValueError(
            f"mla_latent_store: expected kv_a [B, L + R] and store [S, N, L + R] with unit last strides, L "
            f"and R powers of two, slots and positions [B]; got kv_a {tuple(kv_a.shape)}, weight "
            f"{tuple(weight.shape)}, store {tuple(store.shape)}, slots {tuple(slots.shape)}, positions "
            f"{tuple(positions.shape)}"
        )
    if B == 0:
        return
    _mla_latent_store_kernel[(B,)](
        kv_a, weight, store, slots, positions, kv_a.stride(0), store.stride(0), store.stride(1),
        store.shape[1], float(eps), L=L, R=R, num_warps=max(1, min(16, L // 512)), **pdl_args(kv_a),
    )  # fmt: skip


def o_block(batch: int, heads: int) -> int:
    """The o dot form's sequences a block: 32 above O_BLOCK32_FROM (sequence, head) pairs, else 16."""
    return 32 if batch * heads > O_BLOCK32_FROM else 16


def absorb_dot(batch: int, dot: bool | None) -> bool:
    """Whether the absorb kernels take their tensor-core form for `batch` sequences (`dot` None: from
    ABSORB_DOT_FROM; True / False force it, for tests and the benchmark)."""
    return batch >= ABSORB_DOT_FROM if dot is None else dot


def absorb_fma(batch: int, dot: bool | None, fma: bool | None) -> bool:
    """Whether the absorb kernels take their fp32 FMA form (`fma` True / False force it; None: when `dot`
    forces no form and the step has at most K3RUN_MLA_ABSORB_FMA sequences)."""
    if fma is not None:
        return fma
    return dot is None and batch <= knobs().mla_absorb_fma


def mla_q_absorb_triton(
    q: torch.Tensor, w_uk: torch.Tensor, ahead: bool = True, dot: bool | None = None,
    out_dtype: torch.dtype = torch.float32, fma: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """mla_q_absorb_ref in one launch: q [B, H, d_n + R] (unit last stride), w_uk [H, d_n, L] fp32
    contiguous, L and R powers of two -> [B, H, L + R] in out_dtype (the fp32 sums rounded once: the decode
    kernel rounds its queries to a 16-bit cache's dtype anyway, so writing them in it halves what each split
    program reads for the same bits). `ahead`: each sequence's row loaded while the previous one's is used
    (the default; False only for the benchmark's comparison; the loop form only). `dot` (`absorb_dot`): the
    sequences in blocks on the tensor cores (`_mla_q_absorb_dot_kernel`; needs L >= 16); `fma`
    (`absorb_fma`, before `dot`): the same blocks as one fp32 FMA dot."""
    B, H, dq = q.shape
    _, dn, L = w_uk.shape
    R = dq - dn
    if (
        w_uk.shape[0] != H
        or R < 1
        or q.stride(2) != 1
        or not w_uk.is_contiguous()
        or w_uk.dtype != torch.float32
    ):
        raise ValueError(
            f"mla_q_absorb: expected q [B, H, d_n + R] with a unit last stride and a contiguous fp32 W_UK "
            f"[H, d_n, L]; got q {tuple(q.shape)} strides {q.stride()}, W_UK {tuple(w_uk.shape)} {w_uk.dtype}"
        )
    if L & (L - 1) or R & (R - 1):
        raise ValueError(f"mla_q_absorb: L = {L} and R = {R} must be powers of two")
    out = torch.empty(B, H, L + R, dtype=out_dtype, device=q.device)
    if B == 0:
        return out
    bl = min(32, L)
    block_dn = max(16, triton.next_power_of_2(dn))
    fused = absorb_fma(B, dot, fma)
    if (fused or absorb_dot(B, dot)) and L >= 16:
        # bf16 q multiplies the parts exactly as it is; the FMA form takes no parts, 16 sequences a block
        split = not fused and q.dtype != torch.bfloat16
        bb = 16 if split or fused else min(64, max(16, triton.next_power_of_2(B)))
        _mla_q_absorb_dot_kernel[(H, L // bl)](
            q, w_uk, out, B, H, q.stride(0), q.stride(1), DN=dn, L=L, R=R, BLOCK_DN=block_dn, BL=bl, BB=bb,
            QSPLIT=split, TC=TENSOR_CORES, FMA=fused, num_warps=4, **pdl_args(q),
        )  # fmt: skip
        return out
    _mla_q_absorb_kernel[(H, L // bl)](
        q, w_uk, out, B, H, q.stride(0), q.stride(1), DN=dn, L=L, R=R, BLOCK_DN=block_dn, BL=bl,
        AHEAD=ahead, num_warps=4, **pdl_args(q),
    )  # fmt: skip
    return out


def mla_o_absorb_triton(
    o_lat: torch.Tensor, w_uv: torch.Tensor, out_dtype: torch.dtype, ahead: bool = True,
    dot: bool | None = None, tiles: tuple[int, ...] | None = None, fma: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """mla_o_absorb_ref in one launch: o_lat [B, H, L] fp32 contiguous, w_uv [H, d_v, L] fp32 contiguous,
    L a power of two -> [B, H, d_v] in out_dtype. `ahead`, `dot` and `fma` as in `mla_q_absorb_triton`;
    `tiles` (the dot and FMA forms' value columns, latent columns a step and sequences a block, powers of two
    >= 16, and optionally its warps; for the benchmark's variants)."""
    B, H, L = o_lat.shape
    dv = w_uv.shape[1]
    if (
        w_uv.shape[0] != H or w_uv.shape[2] != L or not (o_lat.is_contiguous() and w_uv.is_contiguous())
        or o_lat.dtype != torch.float32 or w_uv.dtype != torch.float32 or L & (L - 1)
    ):  # fmt: skip
        raise ValueError(
            f"mla_o_absorb: expected contiguous fp32 o_lat [B, H, L] and W_UV [H, d_v, L], L a power of two; "
            f"got o_lat {tuple(o_lat.shape)} {o_lat.dtype}, W_UV {tuple(w_uv.shape)} {w_uv.dtype}"
        )
    out = torch.empty(B, H, dv, dtype=out_dtype, device=o_lat.device)
    if B == 0:
        return out
    fused = absorb_fma(B, dot, fma)
    if (fused or absorb_dot(B, dot)) and L >= 16:
        bv, bk, bb, warps = (*tiles, 4)[:4] if tiles else (16, 64, o_block(B, H), 4)
        _mla_o_absorb_dot_kernel[(H, triton.cdiv(dv, bv), triton.cdiv(B, bb))](
            o_lat, w_uv, out, B, H, DV=dv, L=L, BV=bv, BK=min(bk, L), BB=bb, TC=TENSOR_CORES, FMA=fused,
            num_warps=warps, **pdl_args(o_lat),
        )  # fmt: skip
        return out
    bv = 8
    _mla_o_absorb_kernel[(H, triton.cdiv(dv, bv))](
        o_lat, w_uv, out, B, H, DV=dv, L=L, BV=bv, AHEAD=ahead, num_warps=4, **pdl_args(o_lat)
    )
    return out


def choose_splits(
    batch: int, window: int, head_blocks: int, sms: int = 132, min_chunk: int = 64, per_sm: int = 2
) -> int:
    """Splits of the window so that batch x splits x head blocks fills ~`per_sm` programs per SM, with at
    least `min_chunk` positions per split."""
    want = max(1, -(-per_sm * sms // max(1, batch * head_blocks)))
    return max(1, min(want, -(-window // min_chunk)))


def shares_splits(batch: int, window: int, heads: int = 32) -> bool:
    """Whether a step's launch lays its splits out by `_shares` (each sequence's pieces by its length) rather
    than a fixed grid per sequence: where batch x head blocks (32 heads a block) >= 32, or >= 8 at windows of
    32K positions and more. The graph decoder fixes the layout at capture, where the lengths are unknown, so
    the rule goes by size. From H100 A/Bs of the two layouts at 32 and 96 heads (bench/RESULTS.md, runs
    237-241), shared against per sequence: batches of mixed lengths mostly 1.04-2x faster (the long sequence
    gets the spare programs; two exceptions, -7% and -12%); batches of equal lengths 9-35% slower below 8
    pairs, up to 20% slower at 8-24 pairs in windows under 32K, -2..+3% at 8-24 pairs in longer windows, and
    from 32 pairs 5-29% faster (-5% at a 2K window). K3RUN_MLA_SHARED_SPLITS forces either layout."""
    forced = knobs().mla_shared_splits
    if forced is not None:
        return forced
    pairs = batch * -(-heads // BLOCK_HEADS)
    return pairs >= 32 or (pairs >= 8 and window >= 32768)


def decode_config(batch: int, window: int, heads: int = 32) -> dict:
    """Launch options by the step's size, from the H200 sweeps (bench/RESULTS.md): 32-head blocks
    (3 at 96 heads) of 64 positions in the mma form; from 8 sequences on, 4-warp programs at ~4 per SM
    (1.3-2x faster there than 8 warps), below that 8-warp programs at ~2 per SM (4 warps at 4 per SM split
    one sequence's window into too many short chunks). A positions-as-rows form on wgmma is slower than
    these tuned launches (measured in the same sweeps; bench/NOTES.md).
    Splits keep >= 256 positions (`min_chunk`) above 4096-position windows, 64 below: each split re-reads
    the queries and writes [heads, L] fp32 partials, so at long contexts short splits pay more in that
    traffic than their parallelism wins (H100, bench/RESULTS.md: one sequence of 8K at 32 heads 26.8 us
    at 256 against 43.2 at 64), while one sequence of 1K needs the short splits to reach the SMs (12.5 us
    at 64 against 22.3). Below 8 sequences, windows above 4096 positions take three stages: with two, the
    loop waits for each block's own copies before its dots (nothing in flight, bench/probes/
    mla_pipeline.py); three keep one block in flight (H100, 32 heads, 1-4 sequences of 8K-60K: 1.03-1.21x,
    one 184 KB program an SM). `shared`: `shares_splits`."""
    shared = shares_splits(batch, window, heads)
    common = dict(block_h=BLOCK_HEADS, block_n=64, min_chunk=64 if window <= 4096 else 256, shared=shared)
    if batch >= 8:
        return dict(common, num_warps=4, num_stages=2, per_sm=4)
    return dict(common, num_warps=8, num_stages=2 if window <= 4096 else 3, per_sm=2)


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
    **launch,
) -> torch.Tensor:
    """mla_decode_ref's contract (o_lat [B, H, L] fp32) without the window's copies. Launch options
    (block_h, block_n, num_warps, num_stages, per_sm, min_chunk, shared) default to `decode_config(B,
    window, H)`; `launch` overrides some of them (benchmarks, tests). `shared=True` lays the splits out by
    `_shares`: each sequence takes pieces by its length out of SHARED_PER_SM programs an SM (`splits` is then
    the programs shared); `shares_splits` says where the step takes it."""
    B, H, L = q_lat.shape
    _check_store(store, L, q_pe.shape[-1], window)
    cfg = decode_config(B, window, H)
    unknown = set(launch) - set(cfg)
    if unknown:
        raise ValueError(f"mla_decode: unknown launch options {sorted(unknown)}; known: {sorted(cfg)}")
    cfg.update({key: v for key, v in launch.items() if v is not None})
    q = torch.cat([q_lat, q_pe], dim=-1).float().contiguous()  # [B, H, L + R]
    return _decode(q, L, store, slots, context_lens, window, scale, splits, cfg)


def mla_decode_joined_triton(
    q: torch.Tensor, L: int, store: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
    window: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """mla_decode_triton with the queries already joined: q [B, H, L + R] contiguous, fp32 or the cache's
    dtype (the kernel rounds fp32 queries to it: the same bits), as `mla_q_absorb_triton` writes them (no
    concatenation launch)."""
    B, H, LR = q.shape
    R = LR - L
    _check_store(store, L, R, window)
    if q.dtype not in (torch.float32, store.dtype) or not q.is_contiguous():
        raise ValueError(
            f"mla_decode: joined queries must be contiguous, fp32 or the cache's {store.dtype}; got "
            f"{q.dtype} {q.stride()}"
        )
    return _decode(q, L, store, slots, context_lens, window, scale, None, decode_config(B, window, H))


def _check_store(store: torch.Tensor, L: int, R: int, window: int) -> None:
    if store.dim() != 3 or store.shape[2] != L + R or window > store.shape[1]:
        raise ValueError(f"mla_decode: store must be [S, >= {window}, {L + R}], got {tuple(store.shape)}")
    if store.stride(2) != 1:
        raise ValueError(f"mla_decode: store needs a unit last stride, got {store.stride()}")
    if L & (L - 1) or R & (R - 1):
        raise ValueError(f"mla_decode: L = {L} and R = {R} must be powers of two")
    if window * store.stride(1) >= 2**31:
        raise ValueError(f"mla_decode: window {window} x row stride {store.stride(1)} overflows int32")


def _decode(
    q: torch.Tensor, L: int, store: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
    window: int, scale: float, splits: int | None, cfg: dict,
) -> torch.Tensor:  # fmt: skip
    B, H, LR = q.shape
    R = LR - L
    head_blocks = triton.cdiv(H, cfg["block_h"])
    from k3run.kernels.nvfp4_gemm import sm_count

    sms = sm_count(q.device.index or 0) if q.is_cuda else 4
    min_chunk = cfg["min_chunk"]
    shared = bool(cfg.get("shared"))
    if shared:  # `splits` (tests): the programs the pieces share
        total = splits or max(1, -(-SHARED_PER_SM * sms // head_blocks))
        most = max(1, min(total, -(-window // min_chunk)))  # pieces a sequence at most
        # the pieces number <= total + B, and <= B x most (s_b <= max(1, min(total, cdiv(n_b, min_chunk)))):
        # programs past both could never hold one, so the grid stops there (one sequence in a 2K window: 32
        # rows, not 265)
        rows = min(total + B, B * most)
        chunk, grid = 0, (rows, 1, head_blocks)
    else:
        if splits is None:
            splits = choose_splits(B, window, head_blocks, sms, min_chunk, cfg["per_sm"])
        total, rows, chunk, grid = 0, B * splits, triton.cdiv(window, splits), (B, splits, head_blocks)
        most = splits
    o = torch.empty(rows, H, L, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, H, dtype=torch.float32, device=q.device)
    common = dict(L=L, R=R, BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], IEEE=store.dtype == torch.float32,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args(q))  # fmt: skip
    if shared:
        _mla_decode_shared_kernel[grid](
            q, store, slots, context_lens, o, lse, H, B, total, min_chunk, window, store.stride(0),
            store.stride(1), scale, **common,
        )  # fmt: skip
    else:
        _mla_decode_split_kernel[grid](
            q, store, slots, context_lens, o, lse, H, splits, chunk, window, store.stride(0), store.stride(1),
            scale, **common,
        )  # fmt: skip
    out = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    block_s = triton.next_power_of_2(most)
    bl = min(L, MERGE_COLS) if B * H <= MERGE_PAIRS else L
    _mla_merge_kernel[(B, H, L // bl)](
        o, lse, out, context_lens, H, B, splits or 0, total, min_chunk, window, L=L, BLOCK_S=block_s,
        BS=min(block_s, max(1, MERGE_TILE // bl)), BL=bl, SHARED=shared, num_warps=4, **pdl_args(q),
    )  # fmt: skip
    return out
