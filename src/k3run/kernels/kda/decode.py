"""KDA's decode step in one Triton launch: the short conv, the gates, the q/k L2 norm, the recurrent step and
the gated output norm, with the conv windows and the recurrent states read and written in the cache pools.

The unfused step is three launches in a chain (`causal_conv1d_decode_in_place`, fla's
`fused_recurrent_kda_fwd`, the gated RMSNorm). Alone (H100, 32 heads) this kernel takes 0.5x their time at one
sequence, 0.7x at 8, 0.92x at 32 and 1.0x at 64; at K3's 96 heads 1.0x at 8 and 1.17x (slower) at 32. With PDL
it reads its state block before the grid-dependency wait (no kernel of the step before it writes that block),
so the read overlaps the previous launch's end, which fla's kernel cannot do: the full-depth Kimi Linear step
on an H200 is 0.6% / 1.2% / 1.5% / 0.2% faster with it at 1 / 8 / 16 / 32 sequences (bench/RESULTS.md), and
CUDA decode steps take it up to K3RUN_KDA_FUSED_DECODE sequences. Here the
programs of one (sequence, head) split its value columns into NV blocks of BV (fla's split: a [K, BV] fp32
state block fits a program's registers, where the whole [K, K] state does not). Each convolves the head's q
and k channels and its own v channels, normalises q and k, forms the decay and beta, and runs the delta rule
on its state block (read from and written back to the state pool in place). The output norm needs the whole
row: each program stores its output block in fp32, and the last of the head's programs to arrive (an arrival
counter, kernels/counters.py) normalises the row with the gate and shifts the q and k windows, which every
program of the head read. The persistent form (`persist` N) runs the same items on N programs an SM instead,
each loading its next item's state block while it works on the current one; it measured 1.4-1.6x slower
than one program an item (H100, bench/RESULTS.md), so no default takes it. Per head, in order
(K = V = the head dim, fp32):

    q, k, v  = silu(conv(window, x))              (kept in fp32: the unfused path rounds them to x's dtype
                                                  between its launches)
    q        = scale * q / sqrt(sum(q^2) + 1e-6);  k = k / sqrt(sum(k^2) + 1e-6)
    g        = kda_gate(f, A_log, dt_bias, lower_bound);  beta = sigmoid(b)
    S        = S * exp(g)[:, None];  v' = beta * (v - k^T S);  S = S + k v'^T;  o = q^T S
    y        = o * rsqrt(mean(o^2) + eps) * w * sigmoid(gate)      (stored in out's dtype)

A fresh sequence (context length 0) starts from a zero window and a zero state; neither pool row is read, both
are written. The fp32 reference is `kda_decode_fused_ref` (the conv, recurrence and norm references in a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3run.formats._checks import check_shape
from k3run.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _conv_head(x_ptr, cw_ptr, win_ptr, cs, mask, old, W: tl.constexpr):
    """silu(conv) of channels cs in fp32, zero where masked (old: the channels whose windows are read; the
    rest start from zeros). Reads only: `_shift_windows` writes the new windows."""
    x = tl.load(x_ptr + cs, mask=mask, other=0.0)
    win = win_ptr + cs * (W - 1)
    acc = tl.zeros(cs.shape, dtype=tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(win + j, mask=old, other=0.0)
        w = tl.load(cw_ptr + cs * W + j, mask=mask, other=0.0).to(tl.float32)
        acc += w * s.to(tl.float32)
    w_last = tl.load(cw_ptr + cs * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    acc += w_last * x.to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc))
    return tl.where(mask, y, 0.0)


@triton.jit
def _shift_windows(x_ptr, win_ptr, cs, mask, old, W: tl.constexpr, WP: tl.constexpr):
    """The windows of channels cs shifted by one with x appended. A channel's value may live in several
    threads (a replicated layout), so every read of the old windows (these and the conv's) is done before
    the barrier and every write after it."""
    js = tl.arange(0, WP)
    at = win_ptr + cs[:, None] * (W - 1) + js[None, :]
    kept = mask[:, None] & (js[None, :] >= 1) & (js[None, :] < W - 1)
    s = tl.load(at, mask=kept & old[:, None], other=0.0)
    x = tl.load(x_ptr + cs, mask=mask, other=0.0)
    tl.debug_barrier()
    tl.store(at - 1, s, mask=kept)
    tl.store(win_ptr + cs * (W - 1) + (W - 2), x.to(win_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shift_windows_flat(x_ptr, win_ptr, c0, n, ctx, W: tl.constexpr, BF: tl.constexpr):
    """`_shift_windows` for channels c0 .. c0 + n - 1 walked as one flat run: their W - 1 values a channel lie
    back to back, so the n windows are n (W - 1) values in a 1-D block of BF; value f moves to f - 1 within
    its channel and the channel's last takes x. Each value lives in one thread, where the [channels, W - 1]
    block is replicated over the threads (198 -> 160 registers at BV 32 / 4 warps, sm_90, no lower bound;
    alone on an H100 1.03-1.04x faster at 32-64 sequences, level at 1-16).
    ctx: the sequence's context length (0: a fresh sequence, zeros shift in)."""
    f = tl.arange(0, BF)
    ch = f // (W - 1)
    j = f % (W - 1)
    ok = ch < n
    at = win_ptr + c0 * (W - 1) + f
    s = tl.load(at + 1, mask=ok & (j < W - 2) & ((f * 0 + ctx) != 0), other=0.0)
    x = tl.load(x_ptr + c0 + ch, mask=ok & (j == W - 2), other=0.0).to(win_ptr.dtype.element_ty)
    tl.debug_barrier()
    tl.store(at, tl.where(j < W - 2, s, x), mask=ok)


@triton.jit
def _shift_qk_windows(x_ptr, win_ptr, c0, P, K, cs, mask, old, ctx, W: tl.constexpr, WP: tl.constexpr,
                      WK: tl.constexpr, FLAT: tl.constexpr):  # fmt: skip
    """The q and k windows of one head (its q channels start at c0 = cs[0], its k channels P further) shifted
    by `_shift_windows_flat` (FLAT) or `_shift_windows`."""
    if FLAT:
        _shift_windows_flat(x_ptr, win_ptr, c0, K, ctx, W, WK)
        _shift_windows_flat(x_ptr, win_ptr, P + c0, K, ctx, W, WK)
    else:
        _shift_windows(x_ptr, win_ptr, cs, mask, old, W, WP)
        _shift_windows(x_ptr, win_ptr, P + cs, mask, old, W, WP)


@triton.jit
def _item(it, H, NV):
    """(sequence, head, value block) of item `it` in the persistent walk: value block fastest, then head."""
    return it // (H * NV), (it // NV) % H, it % NV


@triton.jit
def _state_block(state_ptr, stride_s0, slot, h, K, ks, vs):
    """The [BK, BV] addresses of head h's state columns vs in pool row `slot`."""
    return state_ptr + slot * stride_s0 + h.to(tl.int64) * K * K + ks[:, None] * K + vs[None, :]


@triton.jit
def _load_state(state_ptr, stride_s0, slots_ptr, ctx_ptr, b, h, K, ks, vs, mk, mv, valid):
    """(context length, slot, state block [BK, BV]) of item (b, h, its value columns vs); valid False: an
    item past the grid's end, nothing read (a zero block). A fresh sequence (context 0) reads no state."""
    ctx = tl.load(ctx_ptr + b, mask=valid, other=0)
    slot = tl.load(slots_ptr + b, mask=valid, other=0).to(tl.int64)
    old = mk & ((ks * 0 + ctx) != 0)
    st = _state_block(state_ptr, stride_s0, slot, h, K, ks, vs)
    return ctx, slot, tl.load(st, mask=old[:, None] & mv[None, :], other=0.0)


@triton.jit
def _kda_item(
    S, ctx, slot, b, h, vb, x_ptr, stride_x, b_ptr, stride_b, f_ptr, stride_f, gate_ptr, stride_g, cw_ptr,
    conv_ptr, stride_c0, a_ptr, dtb_ptr, lower_bound, scale, state_ptr, stride_s0, nw_ptr, eps, out_ptr,
    stride_o, o_ptr, cnt_ptr, H, K, W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, LOWER: tl.constexpr, FLAT: tl.constexpr, WK: tl.constexpr, WV: tl.constexpr,
):  # fmt: skip
    """One (sequence b, head h, value block vb) of the step, its state block S already loaded (after the
    PDL wait: everything the step's projections wrote is read here)."""
    P = H * K
    ks = tl.arange(0, BK)
    mk = ks < K
    vs = vb * BV + tl.arange(0, BV)
    mv = vs < K
    old = mk & ((ks * 0 + ctx) != 0)  # a fresh sequence (context 0) reads no window
    old_v = mv & ((vs * 0 + ctx) != 0)
    st = _state_block(state_ptr, stride_s0, slot, h, K, ks, vs)
    row = x_ptr + b.to(tl.int64) * stride_x
    win = conv_ptr + slot * stride_c0
    c = h * K + ks
    q = _conv_head(row, cw_ptr, win, c, mk, old, W)
    k = _conv_head(row, cw_ptr, win, P + c, mk, old, W)
    v = _conv_head(row, cw_ptr, win, 2 * P + h * K + vs, mv, old_v, W)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)

    z = tl.load(f_ptr + b.to(tl.int64) * stride_f + c, mask=mk, other=0.0).to(tl.float32)
    z += tl.load(dtb_ptr + c, mask=mk, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_ptr + h).to(tl.float32))
    if LOWER:
        g = lower_bound * tl.sigmoid(a * z)
    else:
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    g = tl.where(mk, g, 0.0)
    beta = tl.sigmoid(tl.load(b_ptr + b.to(tl.int64) * stride_b + h).to(tl.float32))

    S = S * tl.exp(g)[:, None]
    v = beta * (v - tl.sum(S * k[:, None], 0))
    S = S + k[:, None] * v[None, :]
    o = tl.sum(S * q[:, None], 0)
    tl.debug_barrier()  # a small block is replicated over threads: every copy read before any is written
    tl.store(st, S, mask=mk[:, None] & mv[None, :])
    # the windows: a program's own v channels; every program of the head read the q and k windows, so with
    # NV > 1 the last to finish shifts those
    if FLAT:
        _shift_windows_flat(row, win, 2 * P + h * K + vb * BV, tl.minimum(K - vb * BV, BV), ctx, W, WV)
    else:
        _shift_windows(row, win, 2 * P + h * K + vs, mv, old_v, W, WP)
    if NV == 1:
        _shift_qk_windows(row, win, h * K, P, K, c, mk, old, ctx, W, WP, WK, FLAT)

    out_row = b.to(tl.int64) * stride_o + h * K
    if NV == 1:
        gate = tl.load(gate_ptr + b.to(tl.int64) * stride_g + h * K + vs, mask=mv, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + vs, mask=mv, other=0.0).to(tl.float32)
        y = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / K + eps)) * w * tl.sigmoid(gate)
        tl.store(out_ptr + out_row + vs, y.to(out_ptr.dtype.element_ty), mask=mv)
    else:  # the head's output row is split over NV programs: the last to finish normalises it
        o_row = o_ptr + b.to(tl.int64) * P + h * K
        tl.store(o_row + vs, o, mask=mv)
        tl.debug_barrier()  # every thread's part stored before the arrival is counted
        cnt = cnt_ptr + b * H + h
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == NV - 1:
            of = tl.load(o_row + ks, mask=mk, other=0.0)
            gate = tl.load(gate_ptr + b.to(tl.int64) * stride_g + c, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + ks, mask=mk, other=0.0).to(tl.float32)
            y = of * (1.0 / tl.sqrt(tl.sum(of * of, 0) / K + eps)) * w * tl.sigmoid(gate)
            tl.store(out_ptr + out_row + ks, y.to(out_ptr.dtype.element_ty), mask=mk)
            _shift_qk_windows(row, win, h * K, P, K, c, mk, old, ctx, W, WP, WK, FLAT)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


@triton.jit
def _kda_decode_fused_kernel(
    x_ptr, stride_x, b_ptr, stride_b, f_ptr, stride_f, gate_ptr, stride_g, cw_ptr, conv_ptr, stride_c0,
    a_ptr, dtb_ptr, lower_bound, scale, state_ptr, stride_s0, slots_ptr, ctx_ptr, nw_ptr, eps, out_ptr,
    stride_o, o_ptr, cnt_ptr, H, K, B, W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, LOWER: tl.constexpr, FLAT: tl.constexpr = False, WK: tl.constexpr = 1,
    WV: tl.constexpr = 1, PDL: tl.constexpr = False, PERSIST: tl.constexpr = False,
):  # fmt: skip
    """Grid (B, H, NV): one program an item (sequence, head, value block). PERSIST: a 1-D grid of G
    programs, each walking items pid, pid + G, ... (value block fastest, then head, then sequence) and
    loading the next item's state block before working on the current one, so that read overlaps the work
    (one more state block of registers)."""
    ks = tl.arange(0, BK)
    mk = ks < K
    # Before the PDL wait: the sequence's slot and context length (written before the step's first kernel)
    # and its state block, which only this layer's launch of the previous step wrote. That launch is complete
    # when this one starts (every kernel of the step waits for its predecessor before letting the next one
    # launch), so the state's read overlaps the previous kernel's end. Everything the step's projections
    # wrote (x, f, b, gate) is read after the wait. (PERSIST: the first item's; the later items' state
    # blocks, loaded after the wait, have the same single writer.)
    if PERSIST:  # the first item: pid
        b, h, vb = _item(tl.program_id(0), H, NV)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
    vs = vb * BV + tl.arange(0, BV)
    ctx, slot, S = _load_state(state_ptr, stride_s0, slots_ptr, ctx_ptr, b, h, K, ks, vs, mk, vs < K, True)
    pdl_enter(PDL)
    if PERSIST:
        G = tl.num_programs(0)
        total = B * H * NV
        for it in range(tl.program_id(0), total, G):
            nxt = it + G
            nb, nh, nvb = _item(nxt, H, NV)
            nvs = nvb * BV + tl.arange(0, BV)
            n_ctx, n_slot, n_S = _load_state(
                state_ptr, stride_s0, slots_ptr, ctx_ptr, nb, nh, K, ks, nvs, mk, nvs < K, nxt < total
            )  # fmt: skip
            _kda_item(
                S, ctx, slot, b, h, vb, x_ptr, stride_x, b_ptr, stride_b, f_ptr, stride_f, gate_ptr, stride_g,
                cw_ptr, conv_ptr, stride_c0, a_ptr, dtb_ptr, lower_bound, scale, state_ptr, stride_s0, nw_ptr,
                eps, out_ptr, stride_o, o_ptr, cnt_ptr, H, K, W, WP, BK, BV, NV, LOWER, FLAT, WK, WV,
            )  # fmt: skip
            S, ctx, slot, b, h, vb = n_S, n_ctx, n_slot, nb, nh, nvb
    else:
        _kda_item(
            S, ctx, slot, b, h, vb, x_ptr, stride_x, b_ptr, stride_b, f_ptr, stride_f, gate_ptr, stride_g,
            cw_ptr, conv_ptr, stride_c0, a_ptr, dtb_ptr, lower_bound, scale, state_ptr, stride_s0, nw_ptr,
            eps, out_ptr, stride_o, o_ptr, cnt_ptr, H, K, W, WP, BK, BV, NV, LOWER, FLAT, WK, WV,
        )  # fmt: skip


def kda_decode_fused_triton(
    qkv: torch.Tensor,
    b: torch.Tensor,
    f: torch.Tensor,
    gate: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
    block_v: int = 32,
    num_warps: int = 4,
    flat_shift: bool = True,
    persist: int = 0,
) -> torch.Tensor:
    """One decode token per sequence, B sequences, H heads of dim K (P = H K):
    qkv [B, 3P] (q | k | v before the conv; unit column stride, any row stride, e.g. a column slice of the
    merged projection output); b [B, H] raw beta logits; f [B, P] raw forget-gate projection; gate [B, P] the
    output gate's logits; conv_weight [3P, W]; conv_pool [S, 3P, W-1] in qkv's dtype with contiguous rows;
    A_log [H]; dt_bias [P]; state_pool [S, H, K, K] fp32, contiguous; slots, context_lens [B];
    norm_weight [K]; block_v: BV, the value columns of one program (a power of two); num_warps: its warps;
    flat_shift: shift the conv windows as flat runs (`_shift_windows_flat`), else as [channels, W - 1] blocks;
    persist: 0, one program an item (sequence, head, value block); N, N programs an SM (on the CPU
    interpreter N programs) each walking items and loading the next one's state while working on this one's.
    Returns the gated-normed output [B, P] in out_dtype (default qkv's dtype); updates conv_pool[slots] and
    state_pool[slots] in place."""
    B, C = qkv.shape
    H = A_log.numel()
    if H == 0 or C % (3 * H):
        raise ValueError(
            f"kda_decode_fused: qkv [B, 3P] must split into 3 x {H} heads, got {list(qkv.shape)}"
        )
    P = C // 3
    K = P // H
    W = conv_weight.shape[-1]
    if qkv.stride(1) != 1:
        raise ValueError(f"kda_decode_fused: qkv needs unit column stride, got {qkv.stride()}")
    check_shape("kda_decode_fused: conv_weight", conv_weight, (C, W))
    conv_ok = conv_pool.dtype == qkv.dtype and conv_pool[0].is_contiguous()
    if tuple(conv_pool.shape[1:]) != (C, W - 1) or not conv_ok:
        raise ValueError(
            f"kda_decode_fused: conv_pool must be [S, {C}, {W - 1}] {qkv.dtype} with contiguous rows, got "
            f"{list(conv_pool.shape)} {conv_pool.dtype}"
        )
    state_ok = state_pool.dtype == torch.float32 and state_pool.is_contiguous()
    if tuple(state_pool.shape[1:]) != (H, K, K) or not state_ok:
        raise ValueError(
            f"kda_decode_fused: state_pool must be a contiguous [S, {H}, {K}, {K}] float32, got "
            f"{list(state_pool.shape)} {state_pool.dtype}"
        )
    check_shape("kda_decode_fused: b", b, (B, H))
    check_shape("kda_decode_fused: f", f, (B, P))
    check_shape("kda_decode_fused: gate", gate, (B, P))
    check_shape("kda_decode_fused: dt_bias", dt_bias.reshape(-1), (P,))
    check_shape("kda_decode_fused: norm_weight", norm_weight, (K,))
    check_shape("kda_decode_fused: slots", slots, (B,))
    check_shape("kda_decode_fused: context_lens", context_lens, (B,))
    for name, t in (("b", b), ("f", f), ("gate", gate)):
        if t.stride(1) != 1:
            raise ValueError(f"kda_decode_fused: {name} needs unit column stride, got {t.stride()}")
    out = torch.empty(B, P, dtype=out_dtype or qkv.dtype, device=qkv.device)
    if B == 0:
        return out
    BK = triton.next_power_of_2(K)
    BV = min(BK, block_v)
    NV = triton.cdiv(K, BV)
    if NV > 1:
        from k3run.kernels.counters import counters

        o_part, cnt = torch.empty(B, P, dtype=torch.float32, device=qkv.device), counters(qkv.device, B * H)
    else:
        o_part = cnt = out  # not read
    if persist < 0:
        raise ValueError(f"kda_decode_fused: persist must be >= 0 programs an SM, got {persist}")
    if persist:
        from k3run.kernels.nvfp4_gemm import sm_count

        sms = sm_count(qkv.device.index or 0) if qkv.is_cuda else 1
        grid: tuple[int, ...] = (min(B * H * NV, sms * persist),)
    else:
        grid = (B, H, NV)
    _kda_decode_fused_kernel[grid](
        qkv, qkv.stride(0), b, b.stride(0), f, f.stride(0), gate, gate.stride(0), conv_weight.contiguous(),
        conv_pool, conv_pool.stride(0), A_log.contiguous(), dt_bias.contiguous(),
        0.0 if lower_bound is None else float(lower_bound), float(scale), state_pool, state_pool.stride(0),
        slots, context_lens, norm_weight.contiguous(), float(eps), out, out.stride(0), o_part, cnt, H, K, B,
        W=W, WP=triton.next_power_of_2(W - 1), BK=BK, BV=BV, NV=NV, LOWER=lower_bound is not None,
        FLAT=flat_shift, WK=triton.next_power_of_2(BK * (W - 1)), WV=triton.next_power_of_2(BV * (W - 1)),
        PERSIST=persist > 0, num_warps=num_warps, **pdl_args(qkv),
    )  # fmt: skip
    return out
