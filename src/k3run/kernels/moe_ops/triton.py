"""Triton kernels of kernels/moe_ops (CUDA). Each replaces a chain of torch launches in a decode step's MoE
with one launch; the fp32 references are in ref.py."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from k3run.kernels.pdl import pdl_args, pdl_enter
from k3run.kernels.tc_split import dot_split, split3

# libdevice's exp / tanh (what torch's CUDA build calls) on the GPU; the interpreter has no libdevice, so
# there exp is tl.exp and tanh its formula (a series near 0)
LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"

# the largest expert count the top-k kernel holds in one program's registers (K3: 896)
MAX_EXPERTS = 1024
# the fewest tokens the router's dot form takes (K3RUN_MOE_ROUTER_DOT bounds the most): on an H100 (dot
# against broadcast partials + top-k, bench_moe_ops) the dot form is slower at 1 token and faster at 8 for
# both Kimi Linear's and K3's routers, and the broadcast form grows ~linearly between: they cross near 4-5
DOT_FROM = 5


@triton.jit
def _exp(x, LIB: tl.constexpr):
    if LIB:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _tanh(x, LIB: tl.constexpr):
    if LIB:
        return libdevice.tanh(x)
    x2 = x * x  # small |x|: the series to x^9 (the formula below cancels there)
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(x) < 0.2, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _weight_tile(w_ptr, E, D, BE: tl.constexpr, BD: tl.constexpr):
    # this program's (expert block, column block) of the fp32 router weight [E, D]. The weight is a
    # parameter that no kernel of the step writes, so the router kernels fetch it before their PDL wait: the
    # fetch overlaps the previous kernel's tail, as the NVFP4 GEMVs' first weight tiles do. (So a caller
    # must not pass a weight that the launch just before wrote, such as a fresh `.contiguous()` copy.)
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    return tl.load(
        w_ptr + e[:, None].to(tl.int64) * D + d[None, :], mask=(e < E)[:, None] & (d < D)[None, :], other=0.0
    )


@triton.jit
def _x_block(x_ptr, t, d, T, D, sx):
    return tl.load(
        x_ptr + t[:, None].to(tl.int64) * sx + d[None, :], mask=(t < T)[:, None] & (d < D)[None, :], other=0.0
    )


@triton.jit
def _partials(
    wv, x_ptr, out_ptr, T, E, D, sx, BE: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    DOT: tl.constexpr = False, AHEAD: tl.constexpr = True, LIB: tl.constexpr = True,
):  # fmt: skip
    # part[s, t, e] = x[t, cols] . W[e, cols] for this program's BE experts and BD columns (the tile wv,
    # read once: many small programs keep enough bytes in flight), every token.
    # Broadcast form (a few tokens): BT tokens at a time, x cast to fp32 as it loads, a [BT, BE, BD] product
    # reduced across threads. DOT form (bf16 x): 16 tokens at a time on the tensor cores, as three bf16 dots
    # with fp32 accumulation, x . lo + x . mid + x . hi (tc_split: the fp32 weight split exactly): every
    # product of a bf16 x and a bf16 part is exact in fp32, so the logit is the fp32 sum of x's exact products
    # with the fp32 weight, as in the broadcast form, only summed in another order. (The interpreter's bf16
    # dot is wrong: there the same parts, widened back to fp32, go through fp32 dots.)
    # With AHEAD the next block's x is loaded before this block's product, so its L2 round trip overlaps the
    # product, the reduction and the store (without, each block waits for its own load first: one round
    # trip a block); the sums are the same either way
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    sd = tl.program_id(1)
    d = sd * BD + tl.arange(0, BD)
    tt = tl.arange(0, BT)
    if DOT:
        w_hi, w_mid, w_lo = split3(tl.trans(wv))  # [BD, BE] each
    if AHEAD:
        xn = _x_block(x_ptr, tt, d, T, D, sx)
    for t0 in range(0, T, BT):
        t = t0 + tt
        if AHEAD:
            xv = xn
            xn = _x_block(x_ptr, t + BT, d, T, D, sx)  # past T: masked, nothing read
        else:
            xv = _x_block(x_ptr, t, d, T, D, sx)
        if DOT:
            part = dot_split(xv, w_hi, w_mid, w_lo, tl.zeros([BT, BE], tl.float32), LIB)  # [BT, BE] fp32
        else:
            part = tl.sum(xv.to(tl.float32)[:, None, :] * wv[None, :, :], axis=2)  # [BT, BE]
        tl.store(
            out_ptr + (sd * T + t[:, None]).to(tl.int64) * E + e[None, :],
            part,
            mask=(t < T)[:, None] & (e < E)[None, :],
        )


@triton.jit
def _sum_partials(p_ptr, off, m, stride, S: tl.constexpr, G: tl.constexpr):
    # the S partial blocks p[s] (at p_ptr + s * stride + off) summed in block order, so the logits are the
    # same bits in every kernel that sums them. G blocks' loads are unrolled together and so in flight at
    # once; a loop that waited for each load in turn spent an L2 round trip per block, which K3's 28 blocks
    # made most of the top-k kernel's time
    lg = tl.load(p_ptr + off, mask=m, other=0.0, cache_modifier=".cg")
    for s0 in range(1, S, G):
        for j in tl.static_range(G):
            lg += tl.load(
                p_ptr + (s0 + j) * stride + off, mask=m & (s0 + j < S), other=0.0, cache_modifier=".cg"
            )
    return lg


@triton.jit
def _router_partials_kernel(
    x_ptr, w_ptr, out_ptr, T, E, D, sx, BE: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    DOT: tl.constexpr = False, PDL: tl.constexpr = False, AHEAD: tl.constexpr = True,
    LIB: tl.constexpr = True,
):  # fmt: skip
    wv = _weight_tile(w_ptr, E, D, BE, BD)
    pdl_enter(PDL)
    _partials(wv, x_ptr, out_ptr, T, E, D, sx, BE, BD, BT, DOT, AHEAD, LIB)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(
            f"router weight: expected a contiguous fp32 [E, D] parameter, got {weight.dtype} with strides "
            f"{tuple(weight.stride())}"
        )


def _in_flight(elements_per_thread: int, splits: int) -> int:
    """G of `_sum_partials`: partial blocks loaded at once, ~128 registers of loads a thread at most."""
    return max(1, min(splits - 1, 128 // max(1, elements_per_thread), 16))


def router_partials(
    x: torch.Tensor, weight: torch.Tensor, dot: bool = False, ahead: bool = True
) -> torch.Tensor:
    """Partial router logits [S, T, E] fp32 of x [T, D] and the contiguous fp32 weight [E, D] over S column
    blocks of 256 (their sum in block order is the logits; `sigmoid_topk_triton` takes them as they are).
    `dot` (bf16 x only): the tokens in blocks of 16 on the tensor cores, the fp32 weight as three exact bf16
    parts (`_partials`' DOT form). `ahead`: each token block's x loaded one block ahead (the default; False
    only for the benchmark's comparison)."""
    _check_weight(weight)
    if dot and x.dtype != torch.bfloat16:
        raise ValueError(f"router_partials: the dot form takes bf16 x (its products exact), got {x.dtype}")
    t, d = x.shape
    e = weight.shape[0]
    bd = 256
    splits = triton.cdiv(d, bd)
    out = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    be, bt = (16, 16) if dot else (8, min(4, triton.next_power_of_2(t)))
    _router_partials_kernel[(triton.cdiv(e, be), splits)](
        x, weight, out, t, e, d, x.stride(0), BE=be, BD=bd, BT=bt, DOT=dot, AHEAD=ahead, LIB=LIBDEVICE,
        num_warps=4, **pdl_args(x),
    )  # fmt: skip
    return out


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, dot: bool = False) -> torch.Tensor:
    """router_logits_ref for x [T, D] with a contiguous fp32 weight [E, D]: the partials (`router_partials`,
    either form) summed in block order (for tests; the router passes the partials to the top-k kernel)."""
    parts = router_partials(x, weight, dot)
    out = parts[0].clone()
    for s in range(1, parts.shape[0]):
        out += parts[s]
    return out


@triton.jit
def _sigmoid_topk_kernel(
    l_ptr, b_ptr, w_ptr, id_ptr, T, E, scale, extra, S: tl.constexpr, G: tl.constexpr, A: tl.constexpr,
    EXTRA: tl.constexpr, RENORM: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
    LIB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # one program per token (one warp up to 256 experts: every reduction a shuffle): the logits as the sum
    # of S partial rows in order, scores in registers, A rounds of "take the largest remaining", each round
    # on a unique int64 key (the choice's order-preserving int32 bits, then the lower expert index), so ties
    # go to the lower index and every pick is a different expert
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    pdl_enter(PDL)
    lg = _sum_partials(l_ptr, t * E + e, m, T * E, S, G)
    s = tl.div_rn(1.0, 1.0 + _exp(-lg, LIB))  # torch's sigmoid: 1 / (1 + exp(-x)), IEEE division
    c = s + tl.load(b_ptr + e, mask=m, other=0.0)
    bits = c.to(tl.int32, bitcast=True)
    k32 = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    k32 = tl.maximum(k32, -2147483647)  # INT32_MIN stays the sentinel's
    key = (k32.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    sentinel = (tl.full([BLOCK_E], -2147483647 - 1, tl.int32).to(tl.int64)) << 32
    key = tl.where(m, key, sentinel)
    a = tl.arange(0, BLOCK_A)
    iv = tl.full([BLOCK_A], -1, tl.int32)
    wv = tl.zeros([BLOCK_A], tl.float32)
    for k in tl.static_range(A):  # the chain: one max per pick
        best = tl.max(key, axis=0)
        idx = (BLOCK_E - 1) - (best & (BLOCK_E - 1)).to(tl.int32)
        hit = e == idx
        # the pick's unbiased score (exact: one nonzero term), gathered in its round: one [A, E] reduction
        # after the loop would hold A x E / 32 values a lane (512 at K3's 16 x 1024) and spill
        wv = tl.where(a == k, tl.sum(tl.where(hit, s, 0.0), axis=0), wv)
        iv = tl.where(a == k, idx, iv)
        key = tl.where(hit, sentinel, key)
    if RENORM:
        wv = tl.div_rn(wv, tl.sum(wv, axis=0) + 1e-20)
    W: tl.constexpr = A + EXTRA  # a row of the outputs: the A picks, then the appended expert if any
    tl.store(w_ptr + t * W + a, wv * scale, mask=a < A)
    tl.store(id_ptr + t * W + a, iv.to(tl.int64), mask=a < A)
    if EXTRA:
        tl.store(w_ptr + t * W + A, 1.0)
        tl.store(id_ptr + t * W + A, extra.to(tl.int64))


def sigmoid_topk_triton(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """sigmoid_topk_ref on CUDA for E <= MAX_EXPERTS (one launch); logits [T, E], or [S, T, E] partials
    (`router_partials`) summed in order; `extra` appends one more column as sigmoid_topk_ref does."""
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    splits, t, e = parts.shape
    cols = top_k + (extra is not None)
    weights = torch.empty(t, cols, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, cols, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    # one warp up to 256 experts (every reduction a shuffle); more above, 8 scores a thread: K3's 1024
    # columns in one warp (32 int64 keys, 32 scores and the loads a lane) would spill
    warps = max(1, block_e // 256)
    _sigmoid_topk_kernel[(t,)](
        parts.contiguous(), bias.contiguous(), weights, ids, t, e, float(scale),
        -1 if extra is None else int(extra), S=splits, G=_in_flight(block_e // (32 * warps), splits), A=top_k,
        EXTRA=int(extra is not None), RENORM=bool(renormalize and top_k > 1),
        BLOCK_A=triton.next_power_of_2(top_k), BLOCK_E=block_e, LIB=LIBDEVICE, num_warps=warps,
        **pdl_args(parts),
    )  # fmt: skip
    return weights, ids


@triton.jit
def _router_one_launch_kernel(
    x_ptr, w_ptr, part_ptr, cnt_ptr, b_ptr, wo_ptr, io_ptr, T, E, D, sx, scale, extra, BE: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr, S: tl.constexpr, G: tl.constexpr, A: tl.constexpr,
    EXTRA: tl.constexpr, RENORM: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
    TB: tl.constexpr, LIB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # The router in one launch. Every program first computes its partial logits exactly as
    # _router_partials_kernel does; the last program to arrive (an arrival counter, reset by it) then sums
    # the partials in block order and picks as _sigmoid_topk_kernel does, TB tokens at a time: the same
    # logits and scores bit for bit, the same picks. S is the grid's column blocks.
    wv = _weight_tile(w_ptr, E, D, BE, BD)
    pdl_enter(PDL)
    _partials(wv, x_ptr, part_ptr, T, E, D, sx, BE, BD, BT)
    tl.debug_barrier()  # every thread's partials stored before the arrival is counted
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        ee = tl.arange(0, BLOCK_E)
        em = ee < E
        bias = tl.load(b_ptr + ee, mask=em, other=0.0)
        a = tl.arange(0, BLOCK_A)
        sentinel = (tl.full([TB, BLOCK_E], -2147483647 - 1, tl.int32).to(tl.int64)) << 32
        W: tl.constexpr = A + EXTRA
        for t0 in range(0, T, TB):
            t = t0 + tl.arange(0, TB)
            tm = t < T
            m2 = tm[:, None] & em[None, :]
            row = t[:, None].to(tl.int64) * E + ee[None, :]
            lg = _sum_partials(part_ptr, row, m2, T * E, S, G)
            sc = tl.div_rn(1.0, 1.0 + _exp(-lg, LIB))
            bits = (sc + bias[None, :]).to(tl.int32, bitcast=True)
            k32 = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            k32 = tl.maximum(k32, -2147483647)
            key = (k32.to(tl.int64) << 32) | (BLOCK_E - 1 - ee).to(tl.int64)[None, :]
            key = tl.where(em[None, :], key, sentinel)
            iv = tl.full([TB, BLOCK_A], -1, tl.int32)
            wk = tl.zeros([TB, BLOCK_A], tl.float32)
            for k in tl.static_range(A):
                best = tl.max(key, axis=1)
                idx = (BLOCK_E - 1) - (best & (BLOCK_E - 1)).to(tl.int32)  # [TB]
                hit = ee[None, :] == idx[:, None]
                pick = tl.sum(tl.where(hit, sc, 0.0), axis=1)  # the pick's unbiased score (one term)
                iv = tl.where(a[None, :] == k, idx[:, None], iv)
                wk = tl.where(a[None, :] == k, pick[:, None], wk)
                key = tl.where(hit, sentinel, key)
            if RENORM:
                wk = tl.div_rn(wk, tl.sum(wk, axis=1)[:, None] + 1e-20)
            om = tm[:, None] & (a[None, :] < A)
            out = t[:, None].to(tl.int64) * W + a[None, :]
            tl.store(wo_ptr + out, wk * scale, mask=om)
            tl.store(io_ptr + out, iv.to(tl.int64), mask=om)
            if EXTRA:
                tl.store(wo_ptr + t.to(tl.int64) * W + A, tl.full([TB], 1.0, tl.float32), mask=tm)
                tl.store(io_ptr + t.to(tl.int64) * W + A, tl.zeros([TB], tl.int64) + extra, mask=tm)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


# partial logits the one-launch router's last program reads at most (T x column blocks x experts x 4 bytes).
# One program sums them (~100 GB/s from L2) and picks for TB tokens at a time, where the two-launch form runs
# a program per token: the saved launch (~1.5-2.5 us in a decode step) pays only for a few tokens. Kimi
# Linear's router is 9 x 256 x 4 bytes a token: up to 4 tokens; K3's (28 x 896 x 4) stays on two launches.
ROUTER_ONE_LAUNCH_MAX_BYTES = 64 << 10


def router_one_launch_fits(t: int, e: int, d: int) -> bool:
    """Whether `route_one_launch_triton` takes a router of e experts over d columns at t tokens."""
    return t * triton.cdiv(d, 256) * e * 4 <= ROUTER_ONE_LAUNCH_MAX_BYTES


def route_one_launch_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`sigmoid_topk_triton(router_partials(x, weight), ...)` in one launch (the same logits, scores and
    picks; the renormalised weights within an fp32 sum's reordering): x [T, D], the contiguous fp32 weight
    [E, D], E <= MAX_EXPERTS."""
    from k3run.kernels.counters import counters

    _check_weight(weight)
    t, d = x.shape
    e = weight.shape[0]
    bd = 256
    splits = triton.cdiv(d, bd)
    cols = top_k + (extra is not None)
    weights = torch.empty(t, cols, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, cols, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    if x.stride(1) != 1:
        x = x.contiguous()
    parts = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    block_e = triton.next_power_of_2(e)
    tb = max(1, min(triton.next_power_of_2(t), 2048 // block_e))
    _router_one_launch_kernel[(triton.cdiv(e, 8), splits)](
        x, weight, parts, counters(x.device, 1), bias.contiguous(), weights, ids, t, e, d, x.stride(0),
        float(scale), -1 if extra is None else int(extra), BE=8, BD=bd, BT=min(4, triton.next_power_of_2(t)),
        S=splits, G=_in_flight(tb * block_e // 128, splits), A=top_k, EXTRA=int(extra is not None),
        RENORM=bool(renormalize and top_k > 1), BLOCK_A=triton.next_power_of_2(top_k), BLOCK_E=block_e, TB=tb,
        LIB=LIBDEVICE, num_warps=4, **pdl_args(x),
    )  # fmt: skip
    return weights, ids


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, n_half, sx, so, beta, rbeta, lbeta, rlbeta, SITU: tl.constexpr, CAP_UP: tl.constexpr,
    BLOCK: tl.constexpr, LIB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    # torch's operations one by one in fp32 (silu = x / (1 + exp(-x)), sigmoid = 1 / (1 + exp(-x)), IEEE
    # divisions, a division by a constant as torch does it: times the fp32 reciprocal), one rounding at the
    # end
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < n_half
    g = tl.load(x_ptr + r * sx + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * sx + n_half + c, mask=m, other=0.0).to(tl.float32)
    if SITU:
        h = beta * _tanh(g * rbeta, LIB) * tl.div_rn(1.0, 1.0 + _exp(-g, LIB))
        if CAP_UP:
            u = lbeta * _tanh(u * rlbeta, LIB)
        h = h * u
    else:
        h = tl.div_rn(g, 1.0 + _exp(-g, LIB)) * u
    tl.store(out_ptr + r * so + c, h.to(out_ptr.dtype.element_ty), mask=m)


def _f32_reciprocal(v: float) -> float:
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(v, dtype=torch.float32))


def gated_triton(
    gu: torch.Tensor, kind: str, beta: float, linear_beta: float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The gated activation of gu [N, 2I] (gate | up; rows may be strided) -> [N, I] in out_dtype."""
    n, two_i = gu.shape
    i = two_i // 2
    out = torch.empty(n, i, dtype=out_dtype, device=gu.device)
    if n == 0 or i == 0:
        return out
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    situ = kind == "situ"
    b = float(beta) if situ else 1.0
    lb = float(linear_beta) if situ and linear_beta is not None else 1.0
    block = min(1024, triton.next_power_of_2(i))
    _gated_kernel[(n, triton.cdiv(i, block))](
        gu, out, i, gu.stride(0), out.stride(0), b, _f32_reciprocal(b), lb, _f32_reciprocal(lb), SITU=situ,
        CAP_UP=situ and linear_beta is not None, BLOCK=block, LIB=LIBDEVICE, num_warps=4, **pdl_args(gu),
    )  # fmt: skip
    return out


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, add_ptr, out_ptr, D, A: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # out[t] = sum over the token's A picks, in slot order, of w[t, k] * y[t * A + k] in fp32, rounded to
    # out's dtype; with add: that rounded sum + add[t], rounded again (as a cast and torch's add would)
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(A):
        w = tl.load(w_ptr + t * A + k)
        acc += w * tl.load(y_ptr + (t * A + k) * D + d, mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:
        a = tl.load(add_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + a
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_triton(
    y: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """combine_ref in one launch: y [T * A, D] contiguous, weights fp32 [T, A] -> [T, D] in out_dtype (add
    [T, D]: added after the rounding to out_dtype)."""
    t, a = weights.shape
    d = y.shape[1]
    if add is not None and tuple(add.shape) != (t, d):
        raise ValueError(f"combine: add must be [{t}, {d}], got {tuple(add.shape)}")
    out = torch.empty(t, d, dtype=out_dtype, device=y.device)
    if t == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(t, triton.cdiv(d, block))](
        y.contiguous(), weights.float().contiguous(), out if add is None else add.contiguous(), out, d, A=a,
        HAS_ADD=add is not None, BLOCK=block, num_warps=4, **pdl_args(y),
    )  # fmt: skip
    return out
