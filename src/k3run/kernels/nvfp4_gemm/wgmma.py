"""NVFP4 W4A16 GEMM on Hopper's wgmma (Gluon, sm_90): 17 to a few hundred rows per weight, dense linears.

y[M, N] = (x[M, K] @ (e2m1(W) * s)[N, K]^T) * global_scale (+ bias), fp32 accumulation, one rounding to x's
dtype at the end; W in the tiled128 layout (package __init__: `tile_split128`), the decode kernels' layout.

Swapped, as the decode kernels: acc[n, t] = sum_k W[n, k] x[t, k], so the weights are wgmma's A operand (M =
64 weight rows per warpgroup, BN = 64 or 128) and a tile of BT tokens its B operand (N = BT, 16..256), so a
few dozen tokens fill an instruction. One program owns a [BN, BT] output tile (a K range of it with split-K)
and walks K in 128-wide chunks through a ring of STAGES shared-memory slots filled by cp.async STAGES - 2
chunks ahead: the chunk's x columns ([BT, 128], the 128-byte swizzled layout wgmma reads; token rows past M
re-read row M - 1, never stored), its tiled128 words ([BN, 16] int32) and scale words ([BN, 2]). Per chunk:
wait for the slot, decode the words with the decode kernels' shift PTX (`tile.word_asm`: e2m1 * s * 2^-7,
exact in 16 bits) straight into wgmma's A registers, issue two asynchronous wgmma (k 0..63, 64..127), refill
the slot of chunk c - 2, and wait for the previous chunk's wgmma.
What the SASS does with that (bench/NOTES.md): ptxas waits for every wgmma right after issuing it
(`WARPGROUP.DEPBAR.LE gsb0, 0x0`), so one program's decode and MMAs do not overlap; programs on the same SM
overlap each other. The PTX keeps the previous chunk's A operand alive only as 16-bit halves, not as the
packed registers the wgmma reads, and with a constant trip count ptxas does not serialize but reuses those
registers while their wgmma is in flight (wrong values, seen in fp16). The K loops therefore run over a
runtime trip count, and a compile test checks the SASS for writes to in-flight A registers.
`ss=True` (off by default): the decoded tile goes to a double buffer in shared memory and wgmma reads it
there, with one fence and barrier per chunk; no registers to protect, so the K loop takes a constant trip
count (`constant_trip_count`) and ptxas keeps two chunks of wgmma in flight. Measured on an H200 it is
0.88-1.33x the register form's time: each wgmma then reads its A operand from shared memory as well as x,
and at 16-128 tokens a tile that is the shared-memory bandwidth's bound (bench/NOTES.md).
The register placement: lane t = 2h + j of a row owns words 8h + 4j + b (b in registers), which puts physical
k = 16t + 4b + 2p + e at the operand's k' = 16b + 8p + 2t + e (a linear layout derived from the operand's, so
the decoded values need no data movement); x's columns are permuted the same way, so the product is
unchanged: by `rs_columns` (one torch copy) before the launch, or with `gather` by the kernel's own copies,
four 4-byte pieces for each 16-byte slot of the shared tile (`_x_columns`). The gathered launch also uses
programmatic dependent launch: its first chunks' weight and scale words are copied before it waits for the
previous kernel, as the decode GEMVs do.
Why the weights are not prefetched into registers: `fence.proxy.async` (the tensor cores' reads of the
cp.async'd x need it) lowers to a MEMBAR that waits for every outstanding load of the thread (bench/NOTES.md);
cp.async copies are not waited by it.
Epilogue: the global scale times 2^7, the bias, the store (through a layout whose threads own 8 consecutive
n of a token row). Split-K: the programs of a tile write fp32 partials; the last to arrive (an acq_rel
counter) sums them in a fixed order, finishes the tile and resets the counter. The roundings are the fp32
tensor-core sums and the output cast, as in the decode and tile kernels.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from k3run.kernels.counters import counters
from k3run.kernels.pdl import launch_pdl
from k3run.knobs import knobs

from .gluon_gemv import SHIFT_OUT_SCALE, _gdc
from .tile import _check_bias, _check_half_x, _check_tiled, word_asm

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _halves16(o, DT: gl.constexpr):
    """uint32 packed pairs -> (low, high) 16-bit floats of type DT."""
    lo = (o & 0xFFFF).to(gl.uint16).to(DT, bitcast=True)
    hi = (o >> 16).to(gl.uint16).to(DT, bitcast=True)
    return lo, hi


@gluon.jit
def _copy_x(x_smem, x_rows, kx, c, nch, STAGES: gl.constexpr):
    """cp.async chunk c's x columns (two [BT, 64] halves) into ring slot c % STAGES; nothing past the last
    chunk. x has K_PAD columns (the launcher pads a narrower x)."""
    if c < nch:
        st = c % STAGES
        _async_load(x_smem.index(2 * st), x_rows + (kx + c * 128))
        _async_load(x_smem.index(2 * st + 1), x_rows + (kx + (c * 128 + 64)))


@gluon.jit
def _copy_w(w_smem, s_smem, w_src, s_src, c, nch, STAGES: gl.constexpr):
    """cp.async chunk c's weight words and scale words into ring slot c % STAGES; nothing past the last."""
    if c < nch:
        st = c % STAGES
        _async_load(w_smem.index(st), w_src + c * 256)
        _async_load(s_smem.index(st), s_src + c * 32)


@gluon.jit
def _issue(x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, c, nch, STAGES: gl.constexpr):
    """cp.async chunk c (x[:, 128c ..] halves, the words, the scale words) into ring slot c % STAGES as one
    group; an empty group past the last chunk keeps the wait counts uniform."""
    _copy_x(x_smem, x_rows, kx, c, nch, STAGES)
    _copy_w(w_smem, s_smem, w_src, s_src, c, nch, STAGES)
    async_copy.commit_group()


@gluon.jit
def _x_columns(LX: gl.constexpr, XG: gl.constexpr):
    """The x column each of a 64-column half's operand positions reads: with XG (x in its natural order) the
    register order, position 16b + 8p + 2t + e <- column 16t + 4b + 2p + e, so each 16-byte slot of the
    shared tile is gathered from four 4-byte pairs (`rs_columns` is the same reorder as a copy); without, x
    was reordered before the launch and position k reads column k."""
    k = gl.arange(0, 64, layout=gl.SliceLayout(0, LX))
    if XG:
        k = 16 * ((k // 2) % 4) + 4 * (k // 16) + 2 * ((k // 8) % 2) + k % 2
    return k


@gluon.jit
def _chunk(
    acc, pa_lo, pa_hi, c, x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, h4, BN: gl.constexpr,
    nch, STAGES: gl.constexpr, ASM: gl.constexpr, DT: gl.constexpr, LW: gl.constexpr,
    LW2: gl.constexpr, LSW: gl.constexpr, LA: gl.constexpr, a_smem, SS: gl.constexpr,
):  # fmt: skip
    """Chunk c: wait for its slot, decode it into wgmma's A operand (registers, or with SS a double buffer in
    shared memory), issue its two wgmma, refill the slot of chunk c - 2, and wait for the previous chunk's
    wgmma."""
    async_copy.wait_group(STAGES - 3)  # this thread's copies of chunk c have landed
    if not SS:
        fence_async_shared()  # ... visible to the tensor cores
    _cta_barrier()  # everyone's; and every warpgroup is done with chunk c - 2's slot
    st = c % STAGES
    # word 8h + 4j + b of a row: lane t = 2h + j, register b
    q = gl.convert_layout(gl.reshape(w_smem.index(st).load(LW2), [BN, 2, 2, 4]), LW)
    sw = gl.expand_dims(gl.expand_dims(s_smem.index(st).load(LSW), 1), 3)  # [BN, 1, 2, 1]: scale word j
    sp = (sw >> (h4 * 16)) & 0xFFFF  # group t = 2h + j's pair: word j, half h (TILED_SCALE_ORDER)
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        asm=ASM, constraints="=r,=r,=r,=r,r,r", args=[q, sp],
        dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1,
    )  # fmt: skip
    a0, a1 = _halves16(o0, DT)
    b0, b1 = _halves16(o1, DT)
    c0, c1 = _halves16(o2, DT)
    d0, d1 = _halves16(o3, DT)
    # word w holds k = 4w + 2p + e in (a0, a1, b0, b1) and 64 + 4w + .. in (c0, c1, d0, d1): [row, h, j, b, p,
    # e] (physical k = 16(2h + j) + 4b + 2p + e) -> the operand's k' = 16b + 8p + 4h + 2j + e
    w_lo = gl.reshape(gl.permute(gl.join(gl.join(a0, b0), gl.join(a1, b1)), [0, 3, 4, 1, 2, 5]), [BN, 64])
    w_hi = gl.reshape(gl.permute(gl.join(gl.join(c0, d0), gl.join(c1, d1)), [0, 3, 4, 1, 2, 5]), [BN, 64])
    if SS:
        # buffer pair c % 2: chunk c - 2's wgmma, its last reader, was waited at the end of chunk c - 1
        ab = 2 * (c % 2)
        a_smem.index(ab).store(w_lo)
        a_smem.index(ab + 1).store(w_hi)
        fence_async_shared()  # the decoded tile and the cp.async'd x visible to the tensor cores
        _cta_barrier()
        acc = warpgroup_mma(a_smem.index(ab), x_smem.index(2 * st).permute((1, 0)), acc, is_async=True)
        x_hi = x_smem.index(2 * st + 1).permute((1, 0))
        acc = warpgroup_mma(a_smem.index(ab + 1), x_hi, acc, is_async=True)
        _issue(x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, c + STAGES - 2, nch, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=[acc])
        return acc, pa_lo, pa_hi
    else:
        a_lo = gl.convert_layout(w_lo, LA)
        a_hi = gl.convert_layout(w_hi, LA)
        acc = warpgroup_mma(a_lo, x_smem.index(2 * st).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a_hi, x_smem.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
        # the refill after the wgmma issue: no fence stands between it and the next DRAM-bound wait
        _issue(x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, c + STAGES - 2, nch, STAGES)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=[acc, pa_lo, pa_hi])
        return acc, a_lo, a_hi


@gluon.jit(do_not_specialize=["nch"])
def _wgmma_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, N_PAD, stride_xm, stride_ym, nch,
    K_PAD: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr,
    PER_COL_GS: gl.constexpr, HAS_BIAS: gl.constexpr, ASM: gl.constexpr, OUT_SCALE: gl.constexpr,
    LW: gl.constexpr, LW2: gl.constexpr, LX: gl.constexpr, ACC: gl.constexpr, LA: gl.constexpr,
    LO: gl.constexpr, XS: gl.constexpr, LCW: gl.constexpr, LCS: gl.constexpr, PS: gl.constexpr,
    SS: gl.constexpr = False, STATIC_NCH: gl.constexpr = False, XG: gl.constexpr = False,
    PDL: gl.constexpr = False,
):  # fmt: skip
    CH: gl.constexpr = K_PAD // 128
    NCH: gl.constexpr = CH // SPLIT_K  # chunks per program
    DT: gl.constexpr = x_ptr.dtype.element_ty
    n_tiles = gl.cdiv(N, BN)
    pid = gl.program_id(0)
    pid_n = pid % n_tiles  # consecutive programs share the token tile (x is the larger operand)
    pid_t = pid // n_tiles
    pid_k = gl.program_id(1)
    c0 = pid_k * NCH  # first chunk of this program

    # ---- copy sources. Words: [BN, 16] int32 (16-byte copies); rows past the tiled weight re-read its last
    # row (never stored). Scale words: [BN, 2] int32 (4-byte copies).
    rw = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LCW)), N_PAD - 1)
    rw2 = gl.expand_dims(rw, 1)
    w_src = w_ptr + (((rw2 // 16).to(gl.int64) * CH + c0) * 256 + (rw2 % 16) * 16
                     + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LCW)), 0))  # fmt: skip
    rsc = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LCS)), N_PAD - 1)
    rs2 = gl.expand_dims(rsc, 1)
    s_src = s_ptr + (((rs2 // 16).to(gl.int64) * CH + c0) * 32 + (rs2 % 16) * 2
                     + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, LCS)), 0))  # fmt: skip
    # x: [BT, 64] halves in the A registers' order, 8 operand positions per thread: 16-byte copies of x
    # reordered by `rs_columns`, or with XG four 4-byte copies of x as it is (`_x_columns`); token rows past
    # M re-read row M - 1
    t = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, LX))
    trow = gl.expand_dims(gl.minimum(t, M - 1), 1).to(gl.int64)
    x_rows = x_ptr + trow * stride_xm
    kx = gl.expand_dims(_x_columns(LX, XG), 0) + c0 * 128
    # the scale half of each decode lane: h of word index 8h + 4j + b
    LSW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, LW))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LW))))
    h4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(h, 0), 2), 3)  # [1, 2, 1, 1]

    x_smem = gl.allocate_shared_memory(DT, [2 * STAGES, BT, 64], XS)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 16], PS)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 2], PS)
    if STATIC_NCH:  # a constant trip count (ss only: see the module docstring)
        nch = NCH
    if SS:  # two chunks' decoded [BN, 64] halves
        a_smem = gl.allocate_shared_memory(DT, [4, BN, 64], XS)
    else:  # unused: the register form's operand lives in registers
        a_smem = x_smem
    if PDL:
        # the first chunks' weight and scale words (parameters: no kernel of the step writes them) are copied
        # while the previous kernel drains; x, the partials and the counters only after it has finished.
        # Group st holds chunk st's x (group 0 also every prologue weight copy), so the loop's wait counts
        # stay those of the one-group-a-chunk prologue below
        for st in gl.static_range(STAGES - 2):
            _copy_w(w_smem, s_smem, w_src, s_src, st, nch, STAGES)
        _gdc("griddepcontrol.wait;")
        for st in gl.static_range(STAGES - 2):
            _copy_x(x_smem, x_rows, kx, st, nch, STAGES)
            async_copy.commit_group()
    else:
        for st in gl.static_range(STAGES - 2):
            _issue(x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, st, nch, STAGES)
    acc = gl.zeros([BN, BT], gl.float32, layout=ACC)
    a_lo = gl.zeros([BN, 64], DT, layout=LA)
    a_hi = gl.zeros([BN, 64], DT, layout=LA)
    for c in range(0, nch):
        acc, a_lo, a_hi = _chunk(
            acc, a_lo, a_hi, c, x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, h4, BN, nch, STAGES, ASM,
            DT, LW, LW2, LSW, LA, a_smem, SS,
        )  # fmt: skip
    if PDL:  # the next launch may stage its own weights now (it waits for this grid before reading outputs)
        _gdc("griddepcontrol.launch_dependents;")
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)

    out = gl.convert_layout(acc, LO)
    n_idx = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LO))
    t_idx = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, LO))
    n2 = gl.expand_dims(n_idx, 1)
    t2 = gl.expand_dims(t_idx, 0)
    if SPLIT_K > 1:
        # partials [SPLIT_K, tiles, BN, BT]; the tile's counter is cnt[pid]
        tile_off = pid.to(gl.int64) * (BN * BT)
        loc = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, LO)), 1) * BT + gl.expand_dims(
            gl.arange(0, BT, layout=gl.SliceLayout(0, LO)), 0
        )
        stride_k = gl.num_programs(0).to(gl.int64) * (BN * BT)
        gl.store(ws_ptr + (pid_k * stride_k + tile_off) + loc, out)
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            out = gl.zeros([BN, BT], gl.float32, layout=LO)
            for sk in gl.static_range(SPLIT_K):
                out += gl.load(ws_ptr + (sk * stride_k + tile_off) + loc, cache_modifier=".cg")
            gl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
            _finish(out, gs_ptr, b_ptr, y_ptr, n_idx, n2, t2, M, N, stride_ym, PER_COL_GS, HAS_BIAS,
                    OUT_SCALE)  # fmt: skip
    else:
        _finish(out, gs_ptr, b_ptr, y_ptr, n_idx, n2, t2, M, N, stride_ym, PER_COL_GS, HAS_BIAS, OUT_SCALE)


@gluon.jit
def _finish(out, gs_ptr, b_ptr, y_ptr, n_idx, n2, t2, M, N, stride_ym, PER_COL_GS: gl.constexpr,
            HAS_BIAS: gl.constexpr, OUT_SCALE: gl.constexpr):  # fmt: skip
    n_ok = n_idx < N
    if PER_COL_GS:
        out = out * gl.expand_dims(gl.load(gs_ptr + n_idx, mask=n_ok, other=0.0) * OUT_SCALE, 1)
    else:
        out = out * (gl.load(gs_ptr) * OUT_SCALE)
    if HAS_BIAS:
        out += gl.expand_dims(gl.load(b_ptr + n_idx, mask=n_ok, other=0.0).to(gl.float32), 1)
    ok = (n2 < N) & (t2 < M)
    gl.store(y_ptr + t2.to(gl.int64) * stride_ym + n2, out.to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def layouts(bn: int, bt: int):
    """(decode words [BN, 2, 2, 4], the same as loaded [BN, 16], x copies [BT, 64], accumulator, A register
    operand [BN, 64], epilogue [BN, BT], x slot shared layout, word copies [BN, 16], scale-word copies [BN,
    2], the words' and scales' shared layout) for a program of BN // 16 warps."""
    warps = bn // 16
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bt, 16])
    # the A operand: k' bit 0 and bits 3-5 in registers with row bit 3, k' bits 1-2 and rows 0-2 in lanes,
    # rows 16+ in warps. Word 8h + 4j + b of a row goes to lane t = 2h + j, register b, so its decoded
    # values land at k' = 16b + 8p + 2t + e without data movement
    la = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    warp_rows = [16 << i for i in range(warps.bit_length() - 1)]
    lw = gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]],
        lane_bases=[[0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[r, 0, 0, 0] for r in warp_rows],
        block_bases=[],
        shape=[bn, 2, 2, 4],
    )
    lw2 = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 1], [0, 2]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[r, 0] for r in warp_rows],
        block_bases=[],
        shape=[bn, 16],
    )
    lx = gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])
    tn = min(32, bn // 8)
    lo = gl.BlockedLayout([8, 1], [tn, 32 // tn], [1, warps], [0, 1])
    xs = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lcw = gl.BlockedLayout([1, 4], [8, 4], [warps, 1], [1, 0])
    lcs = gl.BlockedLayout([1, 1], [16, 2], [warps, 1], [1, 0])
    ps = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    return lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps


def rs_columns(x: torch.Tensor) -> torch.Tensor:
    """x [M, K_pad] with each 64-column half of a chunk reordered for the A registers' order: position 16b +
    8p + 2t + e holds column 16t + 4b + 2p + e (one copy of x)."""
    m, k_pad = x.shape
    return x.reshape(m, k_pad // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k_pad)


def constant_trip_count(ss: bool, chunks: int) -> bool:
    """Whether a program of `chunks` K chunks loops over a constant trip count: the ss form only (the register
    form's constant loop reuses in-flight operand registers, module docstring), from 3 chunks (Triton 3.6
    mis-built constant one- and two-chunk loops around async wgmma)."""
    return ss and chunks >= 3


def _sms(device: torch.device) -> int:
    from . import sm_count

    return sm_count(device.index or 0)


def wgmma_available(device: torch.device) -> bool:
    """sm_90 exactly (wgmma; Blackwell has other tensor-core instructions)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


# (BN, BT) tiles and stages the launcher picks from; see `wgmma_config`
_SMEM_BUDGET = 220 * 1024
_SMEM_PER_SM = 227 * 1024  # an H100 / H200 SM's shared memory for its resident programs


def smem_bytes(bn: int, bt: int, stages: int, ss: bool = False) -> int:
    """Shared memory of one program: the ring of x, word and scale-word slots (+ with ss the two decoded A
    tiles [BN, 128] of the shared-memory operand form)."""
    return stages * (bt * 128 * 2 + bn * 72) + (4 * bn * 128 if ss else 0)


# programs a grid should have, per SM, by rows up to 64 (bench_wgmma.py's sweep of the three K3 shapes):
# each program's chunk chain is serialized (module docstring), so small token tiles want several an SM
_PROGRAMS_PER_SM = ((32, 2.9), (64, 1.45))


# The gathered x copies are 4-byte cp.async from L2, every column tile of weight rows reading all of x: their
# cost grows with cdiv(n, BN) * m * K_pad * 2 bytes. bench_wgmma on an H200 (bench/RESULTS.md): the
# gather won at 4.7-18.9 MB (by 0.5-3.3 us a call) and lost at 28.7 MB (3.6 us) and 57.5 MB (9.9 us).
GATHER_MAX_BYTES = 20 << 20


def gather_x(m: int, n: int, k_pad: int, bn: int) -> bool:
    """Whether an m-row call on BN-row column tiles gathers x in the kernel by default: up to
    K3RUN_WGMMA_X_GATHER rows and GATHER_MAX_BYTES of gathered copies."""
    return m <= knobs().wgmma_x_gather and -(-n // bn) * m * k_pad * 2 <= GATHER_MAX_BYTES


@functools.cache
def wgmma_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int]:
    """(BN, BT, split_k, stages) for a call of m rows on `sms` SMs, from bench/bench_wgmma.py's sweep on an
    H200 (7168x7168, 12288x7168, 7168x12288; bench/RESULTS.md). Token tiles 16 / 32 / 64 / 128 up to 16 / 32 /
    64 / 1024 rows, 256 above. Split-K is 1, 2 or 4, dividing the chunks with >= 3 chunks a program.
    Up to 64 rows: 64 weight rows a program and the smallest split that gives `_PROGRAMS_PER_SM` programs an
    SM (2-3 fit an SM with a 4-slot ring and hide each other's serialized chunks). 65..256 rows (one
    program an SM fits): the (BN 64 / 128, split) whose grid is the largest single wave, the fewest
    programs where none fits in one (fewer splits, then 64 rows, on ties). Up to 256 rows a 4-slot ring;
    above, 128 rows, no split, the deepest ring (<= 8 slots) that fits. Never more slots than a program's
    chunks + 2 (the prologue issues STAGES - 2)."""
    bt = next((b for b in (16, 32, 64) if m <= b), 128 if m <= 1024 else 256)
    chunks = -(-k // 128)
    splits = [s for s in (1, 2, 4) if chunks % s == 0 and (s == 1 or chunks // s >= 3)]

    def programs(bn: int, split: int) -> int:
        return -(-n // bn) * -(-m // bt) * split

    if m <= 64:
        bn = 64
        want = next(p for rows, p in _PROGRAMS_PER_SM if m <= rows) * sms
        split = next((s for s in splits if programs(bn, s) >= want), splits[-1])
        top = 4
    elif m <= 256:
        cands = [(bn, s) for s in splits for bn in (64, 128)]
        one_wave = [c for c in cands if programs(*c) <= sms]
        if one_wave:
            bn, split = max(one_wave, key=lambda c: (programs(*c), -c[1], -c[0]))
        else:
            bn, split = min(cands, key=lambda c: (programs(*c), c[1], c[0]))
        top = 4
    else:
        bn, split, top = 128, 1, 8
    stages = 3
    while stages < min(top, chunks // split + 2) and smem_bytes(bn, bt, stages + 1) <= _SMEM_BUDGET:
        stages += 1
    return bn, bt, split, stages


def nvfp4_wgmma_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    ss: bool = False,
    gather: bool | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, k] @ W^T * global_scale (+ bias) in x's dtype (bf16 / fp16 on sm_90); W in the
    tiled128 layout (uint8 [N_pad, K_pad/2], scales [N_pad, K_pad/16]), global_scale fp32 [1] or [N_pad].
    config: (BN 64 | 128, BT a power of two in 16..256, split_k dividing the 128-wide chunks, stages: 3 to
    the chunks per program + 2); default `wgmma_config`. ss: the A operand from shared memory (the decoded
    tile stored to a double buffer) instead of registers (module docstring: at best 12% faster, often
    slower). gather: the kernel's copies read x as it is, in the operand's column order (`_x_columns`), and
    it launches with PDL where `launch_pdl` (its first weight chunks staged before it waits for the previous
    kernel); otherwise one torch copy reorders x first (`rs_columns`). Default: up to
    K3RUN_WGMMA_X_GATHER rows, where the programs' gathers read at most GATHER_MAX_BYTES."""
    _check_half_x(x, k, "nvfp4 wgmma gemm")
    if not x.is_cuda or not wgmma_available(x.device):
        raise ValueError(f"nvfp4 wgmma gemm: needs an sm_90 GPU, got {x.device}")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("nvfp4 wgmma gemm input: rows must start 16-byte aligned (stride a multiple of 8)")
    n_pad, k_pad = weight.shape[0], weight.shape[1] * 2
    _check_tiled(weight, scale_u8, global_scale, k, n, n_pad, k_pad, "nvfp4 wgmma gemm")
    _check_bias(bias, n, "nvfp4 wgmma gemm")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if k != k_pad:  # the kernel's copies are of whole chunks: zero columns up to K_pad
        x = torch.nn.functional.pad(x, (0, k_pad - k))
    bn, bt, split, stages = config or wgmma_config(m, n, k, _sms(x.device))
    if gather is None:
        gather = gather_x(m, n, k_pad, bn)
    pdl = gather and launch_pdl(x)
    chunks = k_pad // 128
    if (
        bn not in (64, 128)
        or bt not in (16, 32, 64, 128, 256)
        or chunks % split
        or not 3 <= stages <= chunks // max(split, 1) + 2
        or (smem_bytes(bn, bt, stages, ss) > _SMEM_PER_SM)
    ):
        raise ValueError(f"nvfp4 wgmma gemm: bad config {config} for {chunks} chunks")
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, bt), split)
    if split > 1:
        ws = torch.empty((split, grid[0], bn, bt), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, grid[0])
    else:
        ws, cnt = y, y
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps = layouts(bn, bt)
    if not gather:
        x = rs_columns(x)
    _wgmma_kernel[grid](
        x, weight.view(torch.int32), scale_u8.view(torch.int32), global_scale,
        bias if bias is not None else global_scale, y, ws, cnt, m, n, n_pad, x.stride(0), y.stride(0),
        chunks // split,
        K_PAD=k_pad, BN=bn, BT=bt, SPLIT_K=split, STAGES=stages, PER_COL_GS=global_scale.numel() != 1,
        HAS_BIAS=bias is not None, ASM=word_asm("bf16" if x.dtype == torch.bfloat16 else "fp16"),
        OUT_SCALE=SHIFT_OUT_SCALE, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw, LCS=lcs,
        PS=ps, SS=ss, STATIC_NCH=constant_trip_count(ss, chunks // split), XG=gather, PDL=pdl,
        num_warps=bn // 16, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return y


# ---- grouped routed experts ------------------------------------------------------------------------------


@gluon.jit
def _tanh(z):
    """fp32 tanh as tile._tanh: an odd series below |z| = 1/8, else (1 - e) / (1 + e) with e = exp(-2|z|)."""
    a = gl.abs(z)
    z2 = z * z
    small = z * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0))))
    ex = gl.exp(-2.0 * a)
    big = (1.0 - ex) / (1.0 + ex)
    return gl.where(a < 0.125, small, gl.where(z < 0, -big, big))


@gluon.jit
def _sigmoid(z):
    return 1.0 / (1.0 + gl.exp(-z))


@gluon.jit
def _weight_rows(i, pid_n, N_OUT, N_ROWS, HB: gl.constexpr, GATED: gl.constexpr):
    """Program row i -> weight row: rows [0, HB) gate rows pid_n * HB + i, [HB, 2 HB) the matching up rows
    N_OUT + ... (GATED), or pid_n * HB + i; rows past the weight re-read its last row (never stored)."""
    if GATED:
        r = (i // HB) * N_OUT + pid_n * HB + i % HB
    else:
        r = pid_n * HB + i
    return gl.minimum(r, N_ROWS - 1)


@gluon.jit(do_not_specialize=["nch"])
def _wgmma_grouped_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, grp_ptr, N_OUT, N_ROWS, stride_xm, stride_ym, x_div, w_estride,
    s_estride, gs_estride, nch,
    K_PAD: gl.constexpr, R: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, PER_COL_GS: gl.constexpr,
    GATED: gl.constexpr, BETA: gl.constexpr, LINEAR_BETA: gl.constexpr, ASM: gl.constexpr,
    OUT_SCALE: gl.constexpr, LW: gl.constexpr, LW2: gl.constexpr, LX: gl.constexpr, ACC: gl.constexpr,
    LA: gl.constexpr, LO: gl.constexpr, XS: gl.constexpr, LCW: gl.constexpr, LCS: gl.constexpr,
    PS: gl.constexpr, L3: gl.constexpr,
):  # fmt: skip
    """One program: table row `blk` of expert_blocks (expert e, up to BT picks) x HB output columns (R weight
    rows: HB gate + HB up rows when GATED, else HB = R)."""
    NCH: gl.constexpr = K_PAD // 128
    DT: gl.constexpr = x_ptr.dtype.element_ty
    HB: gl.constexpr = R // 2 if GATED else R
    n_tiles = gl.cdiv(N_OUT, HB)
    pid = gl.program_id(0)
    pid_n = pid % n_tiles  # consecutive programs share the block's x rows
    blk = pid // n_tiles
    row0 = grp_ptr + blk.to(gl.int64) * (BT + 1)
    e = gl.load(row0)
    if e >= 0:
        e64 = e.to(gl.int64)
        rw = _weight_rows(gl.arange(0, R, layout=gl.SliceLayout(1, LCW)), pid_n, N_OUT, N_ROWS, HB, GATED)
        rw2 = gl.expand_dims(rw, 1)
        w_src = w_ptr + e64 * w_estride + (
            ((rw2 // 16).to(gl.int64) * NCH) * 256 + (rw2 % 16) * 16
            + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LCW)), 0)
        )  # fmt: skip
        rsc = _weight_rows(gl.arange(0, R, layout=gl.SliceLayout(1, LCS)), pid_n, N_OUT, N_ROWS, HB, GATED)
        rs2 = gl.expand_dims(rsc, 1)
        s_src = s_ptr + e64 * s_estride + (
            ((rs2 // 16).to(gl.int64) * NCH) * 32 + (rs2 % 16) * 2
            + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, LCS)), 0)
        )  # fmt: skip
        # x rows pick // x_div of the block's picks (-1 past its count: row 0, never stored)
        pk = gl.load(row0 + 1 + gl.arange(0, BT, layout=gl.SliceLayout(1, LX)))
        xr = gl.expand_dims(gl.maximum(pk, 0) // x_div, 1).to(gl.int64)
        x_rows = x_ptr + xr * stride_xm
        kx = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LX)), 0)
        LSW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, LW))
        h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LW))))
        h4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(h, 0), 2), 3)

        x_smem = gl.allocate_shared_memory(DT, [2 * STAGES, BT, 64], XS)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, 16], PS)
        s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, 2], PS)
        for st in gl.static_range(STAGES - 2):
            _issue(x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, st, nch, STAGES)
        acc = gl.zeros([R, BT], gl.float32, layout=ACC)
        a_lo = gl.zeros([R, 64], DT, layout=LA)
        a_hi = gl.zeros([R, 64], DT, layout=LA)
        for c in range(0, nch):
            acc, a_lo, a_hi = _chunk(
                acc, a_lo, a_hi, c, x_smem, w_smem, s_smem, x_rows, kx, w_src, s_src, h4, R, nch, STAGES, ASM,
                DT, LW, LW2, LSW, LA, x_smem, False,
            )  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)

        out = gl.convert_layout(acc, LO)
        ro = _weight_rows(gl.arange(0, R, layout=gl.SliceLayout(1, LO)), pid_n, N_OUT, N_ROWS, HB, GATED)
        gsp = gs_ptr + e64 * gs_estride
        if PER_COL_GS:
            out = out * gl.expand_dims(gl.load(gsp + ro) * OUT_SCALE, 1)
        else:
            out = out * (gl.load(gsp) * OUT_SCALE)
        LG: gl.constexpr = gl.SliceLayout(2, L3)
        if GATED:
            # gate and up rounded to the output dtype first (as the unfused path stores them), the activation
            # in fp32, one rounding at the end (layers/activation.py)
            v = out.to(y_ptr.dtype.element_ty).to(gl.float32)
            v3 = gl.convert_layout(gl.permute(gl.reshape(v, [2, HB, BT]), [1, 2, 0]), L3)
            gate, up = gl.split(v3)
            gate = gl.convert_layout(gate, LG)
            up = gl.convert_layout(up, LG)
            if GATED == 1:
                res = gate * _sigmoid(gate) * up
            else:
                res = BETA * _tanh(gate / BETA) * _sigmoid(gate)
                if LINEAR_BETA > 0:
                    up = LINEAR_BETA * _tanh(up / LINEAR_BETA)
                res = res * up
        else:
            res = gl.convert_layout(out, LG)
        n_idx = pid_n * HB + gl.arange(0, HB, layout=gl.SliceLayout(1, LG))
        pt = gl.load(row0 + 1 + gl.arange(0, BT, layout=gl.SliceLayout(0, LG)))
        n2 = gl.expand_dims(n_idx, 1)
        t2 = gl.expand_dims(pt, 0)
        ok = (n2 < N_OUT) & (t2 >= 0)
        gl.store(y_ptr + t2.to(gl.int64) * stride_ym + n2, res.to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def grouped_layouts(r: int, bt: int, gated: bool):
    """`layouts(r, bt)` plus the epilogue's [HB, BT, 2] layout (HB = r / 2 output columns when gated: gate and
    up of a column in one thread's registers; [r, BT, 2] with a unit last dimension otherwise, its slice the
    store layout: 8 consecutive columns of a pick per thread)."""
    warps = r // 16
    hb = r // 2 if gated else r
    tn = min(32, hb // 8)
    l3 = gl.BlockedLayout([8, 1, 2], [tn, 32 // tn, 1], [1, warps, 1], [2, 0, 1])
    return (*layouts(r, bt), l3)


def grouped_config(bt: int, k: int) -> tuple[int, int]:
    """(R weight rows per program, stages) for a grouped call of BT-pick blocks: 128 rows (two warpgroups:
    64 gate + 64 up rows of GEMM1). The ring: 4 slots where that lets two programs share an SM (up to 64
    picks a block), else the deepest (<= 8 slots, <= the chunks + 2) that fits one. Measured on an H200
    (bench/RESULTS.md): Kimi Linear's experts at 4096 tokens (64-pick blocks) 1.40x faster with
    4 slots than with the deepest ring, its 2048-token prefill 1.11x; at 128-pick blocks (its 8192-token
    prefill, K3's experts) 4 slots were 0.98-1.01x, one program an SM either way."""
    chunks = -(-k // 128)
    two = 2 * smem_bytes(128, bt, 4) <= _SMEM_PER_SM
    most = min(4 if two else 8, chunks + 2)
    stages = 3
    while stages < most and smem_bytes(128, bt, stages + 1) <= _SMEM_BUDGET:
        stages += 1
    return 128, stages


def nvfp4_wgmma_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    grp: torch.Tensor,
    *,
    picks: int,
    x_div: int,
    k: int,
    out: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
    activation: tuple[str, float, float | None] | None = None,
) -> torch.Tensor:
    """`tile.nvfp4_tile_gemm_grouped` on wgmma (bf16 / fp16 on sm_90), the same arguments and results: out
    [picks, N] row p = x[p // x_div] @ W[e]^T * global_scale[e] for every pick p of an `expert_blocks` table
    whose width - 1 (the picks per block, BT) is a power of two in 16..256; rows of picks in no block keep
    `out`'s values. activation: gate rows [0, N/2), up rows [N/2, N), out [picks, N/2] = act(gate, up).
    config: (R 64 | 128 weight rows per program, stages); default `grouped_config`."""
    from .tile import _check_grouped

    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"nvfp4 wgmma grouped: x must be bf16/fp16 [rows, {k}] with unit stride along K, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if not x.is_cuda or not wgmma_available(x.device):
        raise ValueError(f"nvfp4 wgmma grouped: needs an sm_90 GPU, got {x.device}")
    ne, n, k_pad, gated, beta, linear_beta, n_out = _check_grouped(
        x, weight, scale_u8, global_scale, grp, k, activation, "nvfp4 wgmma grouped"
    )
    bt = grp.shape[1] - 1
    if bt not in (16, 32, 64, 128, 256):
        raise ValueError(f"nvfp4 wgmma grouped: blocks of {bt} picks; expected a power of two in 16..256")
    if out is None:
        out = torch.zeros((picks, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (picks, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"nvfp4 wgmma grouped: out must be {x.dtype} [{picks}, {n_out}], "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if picks == 0 or grp.shape[0] == 0:
        return out
    r, stages = config or grouped_config(bt, k)
    chunks = k_pad // 128
    if r not in (64, 128) or not 3 <= stages <= chunks + 2 or smem_bytes(r, bt, stages) > _SMEM_PER_SM:
        raise ValueError(f"nvfp4 wgmma grouped: bad config {config} for {chunks} chunks and {bt}-pick blocks")
    if k != k_pad:
        x = torch.nn.functional.pad(x, (0, k_pad - k))
    x = rs_columns(x)
    hb = r // 2 if gated else r
    grid = (grp.shape[0] * triton.cdiv(n_out, hb),)
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps, l3 = grouped_layouts(r, bt, bool(gated))
    _wgmma_grouped_kernel[grid](
        x, weight.view(torch.int32), scale_u8.view(torch.int32), global_scale, out, grp, n_out, n,
        x.stride(0), out.stride(0), x_div, n * k_pad // 8, n * k_pad // 64, global_scale.shape[1], chunks,
        K_PAD=k_pad, R=r, BT=bt, STAGES=stages, PER_COL_GS=global_scale.shape[1] != 1, GATED=gated,
        BETA=beta, LINEAR_BETA=linear_beta, ASM=word_asm("bf16" if x.dtype == torch.bfloat16 else "fp16"),
        OUT_SCALE=SHIFT_OUT_SCALE, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw, LCS=lcs,
        PS=ps, L3=l3, num_warps=r // 16,
    )  # fmt: skip
    return out
