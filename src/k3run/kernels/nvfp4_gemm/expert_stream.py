"""Stream-K form of the expert-major routed-expert decode launch (`gluon_gemv.nvfp4_gemv_by_expert`
with `programs`).

The expert-major launch runs one 1-warp program per (group, 16-row block): at 8 tokens of Kimi Linear
(54-58 experts hit) that is 6,900-7,400 programs of 18 K tiles each over 4,224 resident slots (32 an SM on
an H100 or H200). A program keeps one K tile in flight, so it streams at a fixed rate whatever else runs on
its SM; the launch then takes as many program lifetimes as the busiest slot runs programs: 1.64 lifetimes
of work in 2 (bench/NOTES.md: w13 at 8 tokens 79% of the copy rate on an H100; at 32 tokens, 4.85 in 5,
98%).

Here a fixed grid of S programs (S = SMs x programs an SM, read from `K3RUN_MOE_STREAM` and cut to
`STREAM_RESIDENT`, so every program is resident from the start) splits the launch's
work evenly: the work is the sequence of (item, K tile), item = group g x row block b (b fastest), T =
items x K tiles in all; program p takes tiles [p T / S, (p + 1) T / S). The weight ring (cp.async, `stages`
slots) runs across item boundaries, so a program never drains it between items. S is cut to at most T / (K
tiles an item), so a program's range is at least one item long and an item is split between at most two
programs: the one whose range ends in it (its head) and the one whose range starts in it (its tail). Each
half stores its fp32 partial in its own place of boundary slot p (the later program's index), then adds 1 to
the slot's counter (acq_rel); the second to arrive adds the other partial to its own, runs the epilogue and
puts the counter back to 0. fp32 addition is commutative, so the sum's bits do not depend on which arrives
second: results are deterministic. An item inside one program's range is computed exactly as the
expert-major launch computes it (the same tile order into one accumulator), so with S = the item count (one
item a program) the two launches agree bit for bit.

The group table (`groups.expert_groups`) is read at the start: the expert of every group (one register
column, so a tile's expert is a register select, not a load) and the number of used groups, which sets T. As
in the expert-major launch, PDL waits before the table (GEMM1), or after staging the first tiles when the
table predates the previous launch (`early_table`, GEMM2). GEMM1's gated activation runs in the epilogue
(`act`), as there.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from k3run.kernels.counters import counters
from k3run.kernels.nvfp4_gemm.gluon_gemv import (
    _SCALE_WORD_ASM_BF16,
    _SCALE_WORD_ASM_FP16,
    _TILED_ASM_BF16,
    _TILED_ASM_FP16,
    SHIFT_OUT_SCALE,
    _act_rows,
    _async_load,
    _consume_slot,
    _cta_barrier,
    _finish,
    _finish_act,
    _gdc,
    _load_tables,
    _x_tile_clamped,
    async_layouts,
    decode_tables,
    scale_word_layout,
)

# ptxas register caps by token tile, the lowest without spills in the loop (Triton 3.9's ptxas, strides
# specialised as the runtime does; tests/kernels/test_expert_stream.py): 8 tokens 68-70 registers taken under
# 72, 16 tokens ~92 under 96, 32 tokens ~141 under 160. Left to itself ptxas takes 91-93 at 8 tokens.
STREAM_MAXNREG = {8: 72, 16: 96, 32: 160}
# the programs an SM holds at those caps (sm_90: 64K registers allocated 8 a thread at a time, 32 CTAs): a
# grid larger than SMs x this would start some programs only when others end
STREAM_RESIDENT = {8: 28, 16: 21, 32: 14}


@gluon.jit
def _expert_of(ecol, gidx, g):
    """The expert of group g from the table's first column held in registers (ecol [G_BLOCK]); -1 past
    the used groups, clamped to 0 (such a tile's copy is masked off, its address only has to exist)."""
    return gl.maximum(gl.sum(gl.where(gidx == g, ecol, 0), axis=0), 0).to(gl.int64)


@gluon.jit
def _stream_bases(
    item, ecol, gidx, w_ptr, s_ptr, w_estride, s_estride, rw0, cw, rs0, cs, half_n, NB: gl.constexpr,
    CH: gl.constexpr, ACT: gl.constexpr,
):  # fmt: skip
    """The word and scale pointers of `item`'s K tile 0 (its 16-row block of group item // NB's expert); K
    tile kt is 256 words and 32 scale words further (tiled128: [rows / 16, K_PAD / 128, 16 rows, 16 words]
    and [.., 16 rows, 2 scale words]). Computed once an item, not once a tile."""
    g = item // NB
    e = _expert_of(ecol, gidx, g)
    b = item - g * NB
    rw = b * 16 + rw0
    rs = b * 16 + rs0
    if ACT:
        rw = _act_rows(rw, half_n)
        rs = _act_rows(rs, half_n)
    rw2 = gl.expand_dims(rw, 1)
    rs2 = gl.expand_dims(rs, 1)
    w_row = (rw2 // 16).to(gl.int64) * CH * 16 + rw2 % 16
    s_row = (rs2 // 16).to(gl.int64) * CH * 16 + rs2 % 16
    w_base = w_ptr + e * w_estride + (w_row * 16 + gl.expand_dims(cw, 0))
    s_base = s_ptr + e * s_estride + (s_row * 2 + gl.expand_dims(cs, 0))
    return w_base, s_base


@gluon.jit
def _issue_stream_tile(smem_w, smem_s, w_base, s_base, kt, valid, ok_w, ok_s):
    """cp.async K tile kt of the item whose tile-0 pointers are w_base / s_base into one ring slot; nothing
    is copied unless `valid` (the slot's group is still committed, so every step waits on the same count)."""
    _async_load(smem_w, w_base + kt * 256, mask=ok_w & valid)
    _async_load(smem_s, s_base + kt * 32, mask=ok_s & valid)
    async_copy.commit_group()


@gluon.jit
def _item_tokens(grp_ptr, g, cols, kx, slot_div, stride_xm, BT: gl.constexpr):
    """Group g's token count M and the x offsets [HALF, BT] of its picks' rows; the columns past M read one
    of the group's real rows (never stored), so no column needs a mask."""
    pick = gl.load(grp_ptr + g * (BT + 1) + 1 + cols)
    m = gl.sum((pick >= 0).to(gl.int32), axis=0)
    pick = gl.where(pick >= 0, pick, gl.max(pick, axis=0))
    xrow = gl.expand_dims(pick // slot_div, 0)
    return xrow.to(gl.int64) * stride_xm + kx, m


@gluon.jit
def _expert_stream_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, tab_ptr, grp_ptr, n_groups, N, stride_xm,
    stride_ym, slot_div, w_estride, s_estride, gs_estride, act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n,
    K: gl.constexpr, K_PAD: gl.constexpr, NB: gl.constexpr, PER_COL_GS: gl.constexpr, BT: gl.constexpr,
    STAGES: gl.constexpr, G_BLOCK: gl.constexpr, ASM: gl.constexpr, SCALE_ASM: gl.constexpr,
    MMA: gl.constexpr, LA: gl.constexpr, LW4: gl.constexpr, LB: gl.constexpr, LCW: gl.constexpr,
    SMEM: gl.constexpr, LSW: gl.constexpr, OUT_SCALE: gl.constexpr, PDL: gl.constexpr,
    EARLY: gl.constexpr, ACT: gl.constexpr,
):  # fmt: skip
    BN: gl.constexpr = 16
    BK: gl.constexpr = 128
    HALF: gl.constexpr = 64
    NT: gl.constexpr = K_PAD // BK
    CH: gl.constexpr = K_PAD // 128
    DT: gl.constexpr = x_ptr.dtype.element_ty
    p = gl.program_id(0)
    if PDL and not EARLY:  # the table is the previous kernel's output: wait before reading it
        _gdc("griddepcontrol.wait;")
    # ---- the table's first column in registers, the used groups (a prefix), the even split of the tiles
    LG: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    gidx = gl.arange(0, G_BLOCK, layout=LG)
    ecol = gl.load(grp_ptr + gidx * (BT + 1), mask=gidx < n_groups, other=-1)
    used = gl.sum((ecol >= 0).to(gl.int32), axis=0)
    total = used * (NB * NT)
    progs = gl.minimum(gl.num_programs(0), used * NB)  # at least one whole item a program
    if p >= progs:
        return
    start = ((p.to(gl.int64) * total) // progs).to(gl.int32)
    end = (((p + 1).to(gl.int64) * total) // progs).to(gl.int32)

    tab = _load_tables(tab_ptr)
    rw0 = gl.arange(0, BN, layout=gl.SliceLayout(1, LCW))
    cw = gl.arange(0, 16, layout=gl.SliceLayout(0, LCW))
    LCS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [gl.num_warps(), 1], [1, 0])
    rs0 = gl.arange(0, BN, layout=gl.SliceLayout(1, LCS))
    cs = gl.arange(0, 2, layout=gl.SliceLayout(0, LCS))
    ok_w = gl.full([BN, 16], 1, gl.int1, layout=LCW)
    ok_s = gl.full([BN, 2], 1, gl.int1, layout=LCS)
    smem_w = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 16], SMEM)
    smem_s = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES, BN, 2], SMEM)
    buf = gl.allocate_shared_memory(y_ptr.dtype.element_ty, [BN, BT], SMEM)  # ACT's gate / up exchange
    # the issue side walks (i_item, i_kt) one tile at a time, STAGES - 1 tiles ahead of the compute side
    i_item = start // NT
    i_kt = start - i_item * NT
    w_base, s_base = _stream_bases(i_item, ecol, gidx, w_ptr, s_ptr, w_estride, s_estride, rw0, cw, rs0, cs,
                                   half_n, NB, CH, ACT)  # fmt: skip
    for st in gl.static_range(STAGES - 1):
        _issue_stream_tile(smem_w.index(st), smem_s.index(st), w_base, s_base, i_kt, start + st < end, ok_w,
                           ok_s)  # fmt: skip
        i_kt += 1
        if i_kt == NT:
            i_kt = 0
            i_item += 1
            w_base, s_base = _stream_bases(i_item, ecol, gidx, w_ptr, s_ptr, w_estride, s_estride, rw0, cw,
                                           rs0, cs, half_n, NB, CH, ACT)  # fmt: skip
    if PDL and EARLY:  # x (GEMM1's output), the counters and y may be the previous launches': wait
        _gdc("griddepcontrol.wait;")

    # ---- B side: x columns of the current item's tokens; the epilogue's indices
    kx = gl.expand_dims(gl.arange(0, HALF, layout=gl.SliceLayout(1, LB)), 1)
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, LB))
    L_G: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LW4))
    n_loc = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    te = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(0, MMA)), 0)
    part = gl.expand_dims(n_loc, 1) * BT + te  # a partial's place in its half of a boundary slot
    item = start // NT
    seg0 = start  # the first tile of this program's segment of `item`
    x_off, m = _item_tokens(grp_ptr, item // NB, cols, kx, slot_div, stride_xm, BT)
    acc = gl.zeros([BN, BT], gl.float32, layout=MMA)
    for t in range(start, end):
        kt = t - item * NT
        x_lo, x_hi = _x_tile_clamped(x_ptr, x_off, kx, 0, kt * BK, K, K_PAD)
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile t have landed
        _cta_barrier()  # ... and everyone's; the slot refilled below was read by everyone last step
        nxt = t + STAGES - 1
        i_nxt = (nxt - start) % STAGES
        _issue_stream_tile(smem_w.index(i_nxt), smem_s.index(i_nxt), w_base, s_base, i_kt, nxt < end, ok_w,
                           ok_s)  # fmt: skip
        i_kt += 1
        if i_kt == NT:  # the issue side enters its next item (past the range: masked copies only)
            i_kt = 0
            i_item += 1
            w_base, s_base = _stream_bases(i_item, ecol, gidx, w_ptr, s_ptr, w_estride, s_estride, rw0, cw,
                                           rs0, cs, half_n, NB, CH, ACT)  # fmt: skip
        i_cur = (t - start) % STAGES
        acc = _consume_slot(acc, smem_w.index(i_cur), smem_s.index(i_cur), tab, x_lo, x_hi, BN, HALF, True,
                            ASM, SCALE_ASM, LA, LW4, L_G, DT, LSW)  # fmt: skip
        if (kt == NT - 1) | (t == end - 1):  # the end of this program's segment of the item
            g = item // NB
            b = item - g * NB
            done = t >= start  # (true: an i1 like the counter's answer below)
            if (seg0 != item * NT) | (kt != NT - 1):  # split with the next or previous program
                tail = (seg0 != item * NT).to(gl.int32)  # this segment ends the item: the later program
                bslot = p + 1 - tail
                gl.store(ws_ptr + (bslot * 2 + tail) * (BN * BT) + part, acc)
                _cta_barrier()
                arrived = gl.atomic_add(cnt_ptr + bslot, 1, sem="acq_rel", scope="gpu")
                done = arrived == 1
                if done:  # the other half is in: head + tail, the same bits whichever came second
                    other = (bslot * 2 + 1 - tail) * (BN * BT) + part
                    acc = acc + gl.load(ws_ptr + other, cache_modifier=".cg")
                    gl.atomic_xchg(cnt_ptr + bslot, 0, sem="relaxed", scope="gpu")
            if done:
                e = _expert_of(ecol, gidx, g)
                gs = gs_ptr + e * gs_estride
                grp = grp_ptr + g * (BT + 1)
                out = acc
                if OUT_SCALE != 1.0:
                    out = acc * OUT_SCALE
                n_idx = b * BN + n_loc
                if ACT:
                    _finish_act(out, gs, y_ptr, b, n_idx, stride_ym, m, PER_COL_GS, BN, BT, grp, True, ACT,
                                act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n, SMEM, buf)  # fmt: skip
                else:
                    n2 = gl.expand_dims(n_idx, 1)
                    yrow = gl.load(grp + 1 + gl.minimum(te, m - 1))
                    _finish(out, gs, gs, y_ptr, n_idx, n2, yrow, (n2 < N) & (te < m), stride_ym, PER_COL_GS,
                            False, N)  # fmt: skip
            acc = gl.zeros([BN, BT], gl.float32, layout=MMA)
            item += 1
            seg0 = t + 1
            g_next = gl.minimum(item // NB, used - 1)  # past the range: any used group, never computed
            x_off, m = _item_tokens(grp_ptr, g_next, cols, kx, slot_div, stride_xm, BT)
    if PDL:
        _gdc("griddepcontrol.launch_dependents;")
    async_copy.wait_group(0)


def stream_programs(device: torch.device, per_sm: int, bt: int) -> int:
    """The stream form's grid for token tile bt: `per_sm` programs on every SM, at most STREAM_RESIDENT."""
    from k3run.kernels.nvfp4_gemm import sm_count

    return sm_count(device.index or 0) * min(per_sm, STREAM_RESIDENT[bt])


def launch_stream(
    x: torch.Tensor, weight: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
    groups: torch.Tensor, y: torch.Tensor, slot_div: int, rows: int, programs: int, stages: int, pdl: bool,
    early_table: bool, act_kw: dict,
) -> None:  # fmt: skip
    """The stream form of `gluon_gemv.nvfp4_gemv_by_expert(..., programs=...)` into y, its operands checked
    there: a fixed grid of `programs` 1-warp programs sharing the launch's K tiles evenly (module docstring);
    stages: the weight ring's slots; act_kw: GEMM1's activation arguments (`_act_args`)."""
    n_groups, bt = groups.shape[0], groups.shape[1] - 1
    n_pad, k_pad, k = weight.shape[1], weight.shape[2] * 2, x.shape[1]
    # boundary slot p (1 .. programs - 1) holds the head and tail partials of the item split at p
    ws = torch.empty((programs + 1) * 2 * 16 * bt, dtype=torch.float32, device=x.device)
    cnt = counters(x.device, programs + 1)
    bf16 = x.dtype == torch.bfloat16
    mma, la, lw4, lb, lcw, _, smem = async_layouts(1, bt)
    _expert_stream_kernel[(programs,)](
        x, weight.view(torch.int32), scale_u8.view(torch.int32), global_scale, y, ws, cnt,
        decode_tables(x.device, "bf16" if bf16 else "fp16"), groups, n_groups, rows, x.stride(0), y.stride(0),
        slot_div, n_pad * k_pad // 8, n_pad * k_pad // 64, global_scale.shape[1],
        act_kw.get("act_beta", 1.0), act_kw.get("act_rbeta", 1.0), act_kw.get("act_lbeta", 1.0),
        act_kw.get("act_rlbeta", 1.0), act_kw.get("half_n", 0),
        K=k, K_PAD=k_pad, NB=n_pad // 16, PER_COL_GS=global_scale.shape[1] != 1, BT=bt, STAGES=stages,
        G_BLOCK=max(32, triton.next_power_of_2(n_groups)),
        ASM=_TILED_ASM_BF16 if bf16 else _TILED_ASM_FP16,
        SCALE_ASM=_SCALE_WORD_ASM_BF16 if bf16 else _SCALE_WORD_ASM_FP16, MMA=mma, LA=la, LW4=lw4, LB=lb,
        LCW=lcw, SMEM=smem, LSW=scale_word_layout(1, bt), OUT_SCALE=SHIFT_OUT_SCALE, PDL=pdl,
        EARLY=early_table, ACT=act_kw.get("ACT", 0), num_warps=1, maxnreg=STREAM_MAXNREG[bt], launch_pdl=pdl,
    )  # fmt: skip
