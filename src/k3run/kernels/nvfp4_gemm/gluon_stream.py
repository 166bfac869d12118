"""NVFP4 W4A16 decode GEMM (M <= 16), streaming form: persistent one-warp programs over contiguous tile ranges,
the weights fed by TMA through a deep shared-memory ring (sm_90+, tiled128 layout).

y[M, N] = (x[M, K] @ (e2m1(W) * s)[N, K]^T) * global_scale (+ bias), the same decode and mma as the cp.async
kernel (gluon_gemv.py); what changes is who loads the weights and how the work is cut:
- The tiled128 weights are T = (N_pad / 16) x (K_pad / 128) tiles of 1 KB (+ 128 B of scales), stored tile
  after tile, row block after row block. Program p of G takes the contiguous tiles [p T / G, (p + 1) T / G):
  every program has the same bytes (+- one tile), reads one sequential stretch of memory, and the launch has
  G = a few programs per SM (all resident at once) instead of one per (16 rows, K split).
- One thread issues one TMA copy per tile (words and scales onto one mbarrier) STAGES tiles ahead; no
  registers or address arithmetic hold the loads in flight (the cp.async kernel keeps 1-2 tiles in flight
  per warp; deeper cp.async rings cost it occupancy and lost: bench/NOTES.md).
- A program's range crosses row blocks: it accumulates one row block at a time. A row block inside one
  program is written at once; one shared by c programs (at most MAXC) is reduced like split-K: each writes
  its partial into slot (p - first owner), and the last to arrive (an acq_rel counter) adds the slots in
  order, so results are deterministic for a given (T, G).
Why (bench/NOTES.md, sessions 10-12): the cp.async kernel streams at ~3.4 TB/s in steady state but loses
~2 us per launch to ramp and drain (warps finish at different times; the last ones hold 1-2 tiles in
flight each) and to the split-K tail.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: F401

from k3run.kernels.nvfp4_gemm import gluon_gemv as G

_cta_barrier = G._cta_barrier
TILE_WORDS = 256  # 16 rows x 64 bytes of codes per 128-wide K tile, as int32
TILE_SCALE_WORDS = 32  # 16 rows x 8 E4M3 scales
TILE_BYTES = 4 * (TILE_WORDS + TILE_SCALE_WORDS)


@gluon.jit
def _issue(desc_w, desc_s, bufs_w, bufs_s, bars, slot, tile, pred, GROUP: gl.constexpr):
    """TMA the words and scales of tiles tile .. tile + GROUP - 1 into ring slot `slot` (one mbarrier)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, 1152 * GROUP, pred=pred)
    tma.async_copy_global_to_shared(desc_w, [tile, 0], bar, bufs_w.index(slot), pred=pred)
    tma.async_copy_global_to_shared(desc_s, [tile, 0], bar, bufs_s.index(slot), pred=pred)


@gluon.jit
def _issue_cp(w_ptr, s_ptr, w_offs, s_offs, bufs_w, bufs_s, slot, tile, pred):
    """cp.async the words and scales of the unit starting at tile `tile` into ring slot `slot` (one group)."""
    G._async_load(bufs_w.index(slot), w_ptr + (tile.to(gl.int64) * 256 + w_offs), mask=(w_offs >= 0) & pred)
    G._async_load(bufs_s.index(slot), s_ptr + (tile.to(gl.int64) * 32 + s_offs), mask=(s_offs >= 0) & pred)
    async_copy.commit_group()


@gluon.jit
def _owner(t, T, NPROG):
    """The program whose range [p T / G, (p + 1) T / G) holds unit t."""
    return ((t.to(gl.int64) + 1) * NPROG - 1) // T


@gluon.jit
def _flush(
    acc, rb, pid, NPROG, T, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, KU: gl.constexpr,
    MAXC: gl.constexpr, BT: gl.constexpr, PER_COL_GS: gl.constexpr, HAS_BIAS: gl.constexpr,
    MMA: gl.constexpr,
):  # fmt: skip
    """This program's sum over its tiles of row block rb -> y (sole owner) or its split slot."""
    n_idx = rb * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    t_idx = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    n2 = gl.expand_dims(n_idx, 1)
    te = gl.expand_dims(t_idx, 0)
    out_ok = (n2 < N) & (te < M)
    first = _owner(rb * KU, T, NPROG)  # in units of GROUP tiles
    owners = _owner((rb + 1) * KU - 1, T, NPROG) - first + 1
    if owners == 1:
        G._finish(acc, gs_ptr, b_ptr, y_ptr, n_idx, n2, te, out_ok, stride_ym, PER_COL_GS, HAS_BIAS, N)
    else:
        base = (rb * MAXC).to(gl.int64) * (16 * BT)
        r16 = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, MMA)), 1)
        gl.store(ws_ptr + base + (pid - first) * (16 * BT) + r16 * BT + te, acc, mask=te < M)
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if arrived == owners - 1:
            tot = gl.zeros([16, BT], gl.float32, layout=MMA)
            for c in gl.static_range(MAXC):
                part = gl.load(ws_ptr + base + c * (16 * BT) + r16 * BT + te, mask=(te < M) & (c < owners),
                               other=0.0, cache_modifier=".cg")  # fmt: skip
                tot += part
            gl.atomic_xchg(cnt_ptr + rb, 0, sem="relaxed", scope="gpu")
            G._finish(tot, gs_ptr, b_ptr, y_ptr, n_idx, n2, te, out_ok, stride_ym, PER_COL_GS, HAS_BIAS, N)


@gluon.jit
def _nvfp4_stream_kernel(
    x_ptr, desc_w, desc_s, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, tab_ptr, M, N, stride_xm, stride_ym, T,
    K: gl.constexpr, K_PAD: gl.constexpr, MAXC: gl.constexpr, PER_COL_GS: gl.constexpr,
    HAS_BIAS: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, ASM: gl.constexpr,
    SCALE_ASM: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LW4: gl.constexpr, LB: gl.constexpr,
    LSW: gl.constexpr, OUT_SCALE: gl.constexpr, PDL: gl.constexpr, GROUP: gl.constexpr = 1, CPASYNC: gl.constexpr = False,
):  # fmt: skip
    HALF: gl.constexpr = 64
    KT: gl.constexpr = K_PAD // 128
    KU: gl.constexpr = KT // GROUP  # units (GROUP consecutive K tiles, one TMA copy each) per row block
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    u0 = ((pid.to(gl.int64) * T) // nprog).to(gl.int32)  # T: units in all
    u1 = (((pid + 1).to(gl.int64) * T) // nprog).to(gl.int32)
    n_mine = u1 - u0

    TMA_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    if CPASYNC:  # per-thread 16-byte cp.async copies instead of TMA (same ring, same units)
        bufs_w = gl.allocate_shared_memory(gl.int32, [STAGES, GROUP * 16, 16], PLAIN)
        bufs_s = gl.allocate_shared_memory(gl.int32, [STAGES, GROUP * 16, 2], PLAIN)
        LCW: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])
        LCS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [1, 1], [1, 0])
        rw = gl.arange(0, GROUP * 16, layout=gl.SliceLayout(1, LCW))
        cw = gl.arange(0, 16, layout=gl.SliceLayout(0, LCW))
        w_offs = gl.expand_dims(rw, 1) * 16 + gl.expand_dims(cw, 0)
        rs = gl.arange(0, GROUP * 16, layout=gl.SliceLayout(1, LCS))
        cs = gl.arange(0, 2, layout=gl.SliceLayout(0, LCS))
        s_offs = gl.expand_dims(rs, 1) * 2 + gl.expand_dims(cs, 0)
        for s in gl.static_range(STAGES):
            _issue_cp(w_ptr, s_ptr, w_offs, s_offs, bufs_w, bufs_s, s, (u0 + s) * GROUP, s < n_mine)
    else:
        bufs_w = gl.allocate_shared_memory(gl.int32, [STAGES, GROUP, 256], TMA_L)
        bufs_s = gl.allocate_shared_memory(gl.int32, [STAGES, GROUP, 32], TMA_L)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        # the weights never depend on the previous kernel: fill the ring before waiting for it
        for s in gl.static_range(STAGES):
            _issue(desc_w, desc_s, bufs_w, bufs_s, bars, s, (u0 + s) * GROUP, s < n_mine, GROUP)
    tab = G._load_tables(tab_ptr)
    if PDL:  # x (and ws, the counters, y) may be the previous launch's
        G._gdc("griddepcontrol.wait;")

    # ---- B side [HALF, BT]: x columns of the low nibbles (the high nibbles' are 64 further)
    j = gl.arange(0, HALF, layout=gl.SliceLayout(1, LB))
    tt = gl.arange(0, BT, layout=gl.SliceLayout(0, LB))
    kx = gl.expand_dims(j, 1)
    t2 = gl.expand_dims(tt, 0)
    x_off = gl.minimum(t2, M - 1).to(gl.int64) * stride_xm + kx  # columns >= M re-read row M - 1
    L_G: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LW4))

    rb_first = u0 // KU
    rb_last = (u1 - 1) // KU
    i = 0
    for rb in range(rb_first, rb_last + 1):
        seg0 = gl.maximum(u0, rb * KU)
        seg1 = gl.minimum(u1, (rb + 1) * KU)
        acc = gl.zeros([16, BT], gl.float32, layout=MMA)
        for u in range(seg0, seg1):
            slot = i % STAGES
            if i > 0:
                # refill the previous unit's slot: its words were consumed (decoded, multiplied) last
                # iteration, so the proxy fence Triton puts before a TMA copy waits for no load in flight
                prev = (i - 1) % STAGES
                nxt = i - 1 + STAGES
                if CPASYNC:
                    _issue_cp(w_ptr, s_ptr, w_offs, s_offs, bufs_w, bufs_s, prev, (u0 + nxt) * GROUP, nxt < n_mine)
                else:
                    _issue(desc_w, desc_s, bufs_w, bufs_s, bars, prev, (u0 + nxt) * GROUP, nxt < n_mine, GROUP)
            k0 = (u - rb * KU) * (GROUP * 128)
            x_lo, x_hi = G._x_tile_clamped(x_ptr, x_off, kx, 0, k0, K, K_PAD)  # before the wait: overlaps it
            if CPASYNC:
                async_copy.wait_group(STAGES - 1)  # this thread's copies of unit i have landed
                _cta_barrier()  # ... and everyone's
            else:
                mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            for sub in gl.static_range(GROUP):
                if sub > 0:
                    x_lo, x_hi = G._x_tile_clamped(x_ptr, x_off, kx, 0, k0 + sub * 128, K, K_PAD)
                wv = bufs_w.index(slot)._reinterpret(gl.int32, [GROUP, 16, 16], PLAIN).index(sub)
                p = wv.reshape([16, 4, 2, 2]).load(LW4)
                s_w = bufs_s.index(slot)._reinterpret(gl.int32, [GROUP, 16, 2], PLAIN).index(sub).load(LSW)
                s_a, s_b = gl.inline_asm_elementwise(
                    asm=SCALE_ASM, constraints="=r,=r,r", args=[s_w.to(gl.uint32, bitcast=True)],
                    dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1,
                )  # fmt: skip
                s_pair = gl.reshape(gl.permute(gl.join(s_a, s_b), [0, 2, 1]), [16, 4])
                s_pair = gl.convert_layout(s_pair, L_G, assert_trivial=True)
                s_pair = gl.expand_dims(gl.expand_dims(s_pair, 2), 3)
                a_lo, a_hi = G._decode_operands(p, s_pair, tab, 16, HALF, ASM, LA, DT)
                acc = mma_v2(a_lo, x_lo, acc)
                acc = mma_v2(a_hi, x_hi, acc)
            i += 1
        if rb == rb_last:
            if PDL:  # the next launch may start (its ring fill overlaps this one's last writes)
                G._gdc("griddepcontrol.launch_dependents;")
        if OUT_SCALE != 1.0:
            acc = acc * OUT_SCALE
        _flush(acc, rb, pid, nprog, T, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, KU, MAXC, BT,
               PER_COL_GS, HAS_BIAS, MMA)  # fmt: skip
    if CPASYNC:
        async_copy.wait_group(0)
    else:
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


@functools.cache
def max_owners(tiles: int, programs: int, kt: int) -> int:
    """The most programs sharing one row block of kt tiles when `tiles` are cut into `programs` ranges."""
    owner = lambda t: ((t + 1) * programs - 1) // tiles  # noqa: E731
    return max(owner((rb + 1) * kt - 1) - owner(rb * kt) + 1 for rb in range(tiles // kt))


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_DESCS: dict[tuple, object] = {}


def _descriptors(weight: torch.Tensor, scale_u8: torch.Tensor, tiles: int, group: int):
    """TMA descriptors of the tiled128 words [T, 256] and scale words [T, 32] (int32), one box per tile."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (weight.data_ptr(), scale_u8.data_ptr(), tiles, group, weight.device)
    d = _DESCS.get(key)
    if d is None:
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        w = weight.view(torch.int32).view(tiles, TILE_WORDS)
        s = scale_u8.view(torch.int32).view(tiles, TILE_SCALE_WORDS)
        d = (
            TensorDescriptor(w, [tiles, TILE_WORDS], [TILE_WORDS, 1], [group, TILE_WORDS], lay),
            TensorDescriptor(s, [tiles, TILE_SCALE_WORDS], [TILE_SCALE_WORDS, 1], [group, TILE_SCALE_WORDS], lay),
        )
        if len(_DESCS) > 4096:
            _DESCS.clear()
        _DESCS[key] = d
    return d


def nvfp4_gemv_stream(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    rows: int,
    per_sm: int = 16,
    stages: int = 2,
    programs: int | None = None,
    maxnreg: int | None = None,
    pdl: bool | None = None,
    group: int | None = None,
    cp_async: bool = False,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T * global_scale (+ bias), M <= 16, bf16/fp16 x, tiled128 weights, sm_90+.

    weight / scale_u8: tiled128 uint8 [N_pad, K_pad / 2] / [N_pad, K_pad / 16] (rows padded to 16; `rows` = N).
    programs (default per_sm x SMs, at most one per tile): the persistent one-warp programs; stages: ring slots
    per program, each `group` consecutive tiles loaded by one TMA copy (of the words, one of the scales). pdl (default on): the ring fills before waiting for the previous kernel."""
    from k3run.kernels.nvfp4_gemm.triton import _check

    n_pad = _check(x, weight, scale_u8, global_scale, x.shape[-1], None)
    cap = torch.cuda.get_device_capability(x.device)
    if cap < (9, 0):
        raise ValueError("nvfp4_gemv_stream: needs sm_90+ (TMA)")
    if n_pad % 16 or not n_pad - 16 < rows <= n_pad:
        raise ValueError(f"nvfp4_gemv_stream: a tiled weight has rows padded to 16: {n_pad} rows for N={rows}")
    if bias is not None and (bias.shape != (rows,) or not bias.is_contiguous()):
        raise ValueError(f"nvfp4 bias: expected contiguous [{rows}], got {tuple(bias.shape)}")
    m, k = x.shape
    if m > 16:
        raise ValueError(f"nvfp4_gemv_stream: M={m} > 16")
    k_pad = weight.shape[1] * 2
    kt = k_pad // 128
    if group is None:  # the largest of 4 / 2 / 1 dividing a row's K tiles
        group = 4 if kt % 4 == 0 else 2 if kt % 2 == 0 else 1
    if stages < 2 or group not in (1, 2, 4, 8, 16):
        raise ValueError(f"nvfp4_gemv_stream: stages={stages}, group={group}; expected >= 2 and a power of 2 <= 16")
    y = torch.empty((m, rows), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if kt % group:
        raise ValueError(f"nvfp4_gemv_stream: group={group} does not divide the {kt} K tiles of a row")
    tiles = (n_pad // 16) * kt
    units = tiles // group
    nprog = min(units, programs or per_sm * sm_count(x.device))
    maxc = max_owners(units, nprog, kt // group)
    bt = 8 if m <= 8 else 16
    if maxc > 1:
        ws = torch.empty((n_pad // 16) * maxc * 16 * bt, dtype=torch.float32, device=x.device)
        cnt = G._counters(x.device, n_pad // 16)
    else:
        ws = cnt = y
    pdl = True if pdl is None else pdl
    bf16 = x.dtype == torch.bfloat16
    mma, la, lw4, lb, _, _, _ = G.async_layouts(1, bt)
    desc_w, desc_s = _descriptors(weight, scale_u8, tiles, group)
    _nvfp4_stream_kernel[(nprog,)](
        x, desc_w, desc_s, weight.view(torch.int32), scale_u8.view(torch.int32), global_scale, bias if bias is not None else global_scale, y, ws, cnt,
        G.decode_tables(x.device, "bf16" if bf16 else "fp16"), m, rows, x.stride(0), y.stride(0), units,
        K=k, K_PAD=k_pad, MAXC=maxc, PER_COL_GS=global_scale.numel() != 1, HAS_BIAS=bias is not None, BT=bt,
        STAGES=stages, ASM=G._TILED_ASM_BF16 if bf16 else G._TILED_ASM_FP16,
        SCALE_ASM=G._SCALE_WORD_ASM_BF16 if bf16 else G._SCALE_WORD_ASM_FP16, MMA=mma, LA=la, LW4=lw4, LB=lb,
        LSW=G.scale_word_layout(1, bt), OUT_SCALE=G.SHIFT_OUT_SCALE, PDL=pdl, GROUP=group, CPASYNC=cp_async,
        num_warps=1, maxnreg=maxnreg or G.MAXNREG[bt], launch_pdl=pdl,
    )  # fmt: skip
    return y
