"""NVFP4 W4A16 decode GEMM (M <= 32) in Gluon: weights decoded straight into mma.sync operand registers.

y[M, N] = (x[M, K] @ (e2m1(W) * s)[N, K]^T) * global_scale (+ bias), fp32 accumulation, M <= 32 a launch
(nvfp4_linear splits 33..64 rows into two).

Why Gluon, not plain Triton: the Triton kernel (triton.py) decodes a tile in a blocked layout and lets the
compiler move it into the dot-operand layout through shared memory; on an H200 that ran at ~0.7 TB/s of
weight bytes (bench/NOTES.md). Here every tensor has an explicit layout:
- The computation is swapped: acc[n, t] = sum_k W[n, k] x[t, k], so the weights are the mma A operand
  (16 rows per warp) and the <= 32 tokens the B operand (a token tile of 8, 16 or 32 columns, the smallest
  that holds M; mma.sync m16n8k16).
- The split128 bytes are loaded directly in the A operand layout with k_width = 8 (each thread owns 8
  consecutive bytes of a row: 64-bit loads, a full 32-byte sector per 4 lanes), seen as a 3-D tensor
  [BN, runs, 8] so each thread's group scale (one per 8-byte run) broadcasts along the register dimension.
  The PTX decoder of triton.py (byte-permute table, sign, packed multiply by the scale) turns 4 bytes into
  8 bf16/fp16 weights in place; the reshape back to [BN, BK/2] and the conversion to the dot layout are
  checked to move no data (`assert_trivial`).
- 128-wide K tiles of words and scale bytes are staged through `STAGES` shared-memory slots by cp.async
  (STAGES - 1 tiles in flight per warp without holding registers); on sm_89+ one cvt.f16x2.e4m3x2 converts a
  run's scale pair.
- On the tiled128 layout (tile-contiguous, each word's bits placed by TILED_PAIR_BITS) weights are decoded
  by shifts and masks (`tiled_word_decode_asm`: 11 integer instructions per 8 weights for bf16) and scales
  by one exponent add; the split128 layout (sm_80 / sm_86) takes the byte-permute decoder.
- Split-K: grid (N / BN, SPLIT_K). Each program writes an fp32 partial; the last program of a row block
  to arrive (an acq_rel counter) adds the partials in a fixed order, applies the global scale and the
  bias and writes y, then resets the counter, so one launch does everything and results are deterministic.
- With `pdl` (the default on sm_90+) consecutive launches overlap (programmatic dependent launch).
The same kernel runs the routed experts (`nvfp4_gemv_grouped`, `nvfp4_gemv_by_expert`). The measurements
and the ncu analysis behind this design: bench/NOTES.md "v4" to "v6".
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from k3run.kernels.counters import counters
from k3run.kernels.nvfp4_gemm import (  # noqa: F401 (re-exported)
    CHUNK,
    TILED_PAIR_BITS,
    tile_split128,
    untile_split128,
)
from k3run.kernels.nvfp4_gemm.triton import PRMT_TABLES

# the CTA barrier is gl.thread_barrier in Triton 3.6 and gl.barrier in later releases
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# cp.async global -> shared: async_copy_global_to_shared in Triton 3.6, async_load in later releases
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

K_WIDTH = 8  # consecutive k per thread in the mma operand layouts (= one 8-byte run of split128 bytes)

# One call decodes one 32-bit word of split128 bytes b0..b3 ($4; nibbles n0 = b0 low, n1 = b0 high, ...):
# $0 = (b0 low, b1 low), $1 = (b2 low, b3 low), $2 = (b0 high, b1 high), $3 = (b2 high, b3 high), each a
# packed pair of 16-bit floats times its scale. $5 holds the low nibbles' scale in its low half and the
# high nibbles' scale in its high half. Magnitudes: two byte-permute lookups (high / low byte of the float)
# per 4 nibbles; signs: one permute in sign-replicate mode turns each nibble's sign bit (moved to a byte's
# top bit) into 0xFF / 0x00, and one LOP3 (a | (b & 0x80808080)) sets the high bytes' sign bits; two
# permutes build the pairs, then one packed multiply per pair (exact: e2m1 * e4m3 has <= 6 significant bits).
# both decoders end alike: the run's two scales ($5: the low nibbles' in the low half, the high nibbles' in
# the high half) broadcast to packed pairs, then one packed multiply per output pair
_SCALE_PAIRS = """mov.b32 {s0, s1}, $5;
mov.b32 sl, {s0, s0};
mov.b32 sh, {s1, s1};
mul.rn.TY $0, $0, sl;
mul.rn.TY $1, $1, sl;
mul.rn.TY $2, $2, sh;
mul.rn.TY $3, $3, sh;
}
"""
_WORD_ASM = """
{
.reg .b32 th0, th1, tl0, tl1, m, m2, h01, l01, h23, l23, t, sg, sl, sh;
.reg .b16 s0, s1;
mov.b32 th0, $6;
mov.b32 th1, $7;
mov.b32 tl0, $8;
mov.b32 tl1, $9;
and.b32 m, $4, 0x77777777;
shr.b32 m2, m, 16;
prmt.b32 h01, th0, th1, m;
prmt.b32 l01, tl0, tl1, m;
prmt.b32 h23, th0, th1, m2;
prmt.b32 l23, tl0, tl1, m2;
shl.b32 t, $4, 4;
prmt.b32 sg, t, $4, 0xD9C8;
lop3.b32 h01, h01, sg, 0x80808080, 0xF8;
prmt.b32 sg, t, $4, 0xFBEA;
lop3.b32 h23, h23, sg, 0x80808080, 0xF8;
prmt.b32 $0, l01, h01, 0x6240;
prmt.b32 $1, l23, h23, 0x6240;
prmt.b32 $2, l01, h01, 0x7351;
prmt.b32 $3, l23, h23, 0x7351;
"""
_WORD_ASM += _SCALE_PAIRS


def word_decode_asm(kind: str) -> str:
    """The PTX decoding one split128 word for kind "bf16" or "fp16" (also run by the CPU emulator test).

    The four byte-permute table words come in as operands $6..$9 (`decode_tables`), loaded once per program
    from global memory: as immediates inside the block, ptxas re-materialised them before every use (one
    move per table lookup, ~0.5 instructions per weight)."""
    return _WORD_ASM.replace("TY", "bf16x2" if kind == "bf16" else "f16x2")


def decode_table_words(kind: str) -> list[int]:
    """Operands $6..$9 of word_decode_asm(kind), then the bf16 bits of (2^112, 2^112) for the split128 bf16
    scale asm."""
    (hb0, hb1), (lb0, lb1) = PRMT_TABLES[kind]
    return [hb0, hb1, lb0, lb1, 0x77807780]


_TABLES: dict[tuple[torch.device, str], torch.Tensor] = {}


def decode_tables(device: torch.device, kind: str) -> torch.Tensor:
    """decode_table_words(kind) as an int32 tensor on `device` (made once)."""
    key = (device, kind)
    if key not in _TABLES:
        words = [w - (1 << 32) if w >= 1 << 31 else w for w in decode_table_words(kind)]
        _TABLES[key] = torch.tensor(words, dtype=torch.int32, device=device)
    return _TABLES[key]


_ASM_BF16 = gl.constexpr(word_decode_asm("bf16"))
_ASM_FP16 = gl.constexpr(word_decode_asm("fp16"))

# The tiled layout (tile_split128) places the 32 bits of each word for this decoder (TILED_PAIR_BITS): every
# output pair's two signs and two 3-bit magnitudes sit at the same offsets of the word's two 16-bit halves, so
# shifts of the whole word and masks move both at once. The sign goes to bit 15 of its half and the magnitude
# to bits 8..6 (bf16: the bits of e2m1 * 2^-126, the e = 0 codes as bf16 subnormals with the same factor) or
# 11..9 (fp16: e2m1 * 2^-14); one packed multiply by the scale times 2^119 (bf16) or 2^7 (fp16), built by the
# scale asm below, gives e2m1 * s * 2^-7 exactly (<= 6 significant bits; no underflow: the smallest nonzero
# product is 2^-17); the kernel multiplies the output by 2^7 (SHIFT_OUT_SCALE). bf16: 11 integer
# instructions per 8 weights (7 on the ALU pipe, 4 shifts as IMAD on the FMA pipe), against 14 + 4 constant
# moves for split128's byte-permute decoder (bench/NOTES.md "v6").
SHIFT_OUT_SCALE = 128.0  # the shift decoders' weights are e2m1 * s * 2^-7


def tiled_word_decode_asm(kind: str) -> str:
    """The PTX decoding one tiled128 word ($4) with the scale pair $5 into 4 packed pairs $0..$3, for kind
    "bf16" or "fp16" (the shift decoder described above)."""
    target = 6 if kind == "bf16" else 9  # lowest magnitude bit of the 16-bit float
    mag_mask = 0x00070007 << target
    lines = [".reg .b32 a, b, sl, sh;", ".reg .b16 s0, s1;"]
    for j, (xs, ys) in enumerate(TILED_PAIR_BITS):
        ds, dm = 15 - xs, target - ys  # left shifts of the sign and of the magnitude
        if ds == dm:  # one shift moves both (the bf16 spacing)
            src = "$4"
            if ds:
                lines.append(f"shl.b32 a, $4, {ds};")
                src = "a"
            lines.append(f"and.b32 ${j}, {src}, 0x{0x80008000 | mag_mask:08X};")
            continue
        sign = "$4"
        if ds:
            lines.append(f"shl.b32 a, $4, {ds};")
            sign = "a"
        lines.append(f"shl.b32 b, $4, {dm};" if dm > 0 else f"shr.b32 b, $4, {-dm};")
        lines.append(f"and.b32 b, b, 0x{mag_mask:08X};")
        lines.append(f"lop3.b32 ${j}, {sign}, 0x80008000, b, 0xEA;")  # (sign & 0x80008000) | b
    ty = "bf16x2" if kind == "bf16" else "f16x2"
    return "\n{\n" + "\n".join(lines) + "\n" + _SCALE_PAIRS.replace("TY", ty)


_TILED_ASM_BF16 = gl.constexpr(tiled_word_decode_asm("bf16"))
_TILED_ASM_FP16 = gl.constexpr(tiled_word_decode_asm("fp16"))


@functools.cache
def _linear_bases(layout: gl.DistributedLayout, shape: tuple[int, ...]) -> gl.DistributedLinearLayout:
    """Triton's own linear form of `layout` over `shape` (host side, no GPU needed)."""
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    return builder.to_linear_layout(layout._to_ir(builder), list(shape))


@functools.cache
def gemv_layouts(num_warps: int, block_n: int, block_k: int, block_t: int, token_warps: int = 1):
    """(mma layout, A dot layout [BN, BK/2], the word layout [BN, BK/16, 2], B dot layout [BK/2, BT]).

    The word layout holds the split128 bytes as 32-bit words: k bit 2 of the A layout becomes the word
    index w, k bits >= 3 the run; k bits 0 and 1 (the 4 bytes of a word) are added back by two joins
    after the decode, so the decoded tile lands in the A layout with no data movement.
    num_warps warps split the rows (16 each); token_warps split the token columns: each of those warps
    holds its own BT / token_warps columns of x and of the accumulator and decodes the same weight rows
    (the A operand is replicated across them).
    """
    mma = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[num_warps, token_warps], instr_shape=[16, 8]
    )
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=K_WIDTH)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=K_WIDTH)
    half = block_k // 2
    lin = _linear_bases(a, (block_n, half))

    def to_words(bases: list[list[int]]) -> list[list[int]]:
        out = []
        for r, k in bases:
            if k in (1, 2):
                continue  # a byte within the word: rebuilt by the joins
            out.append([r, 0, 1] if k == 4 else [r, k // K_WIDTH, 0])
        return out

    if lin.reg_bases[:2] != [[0, 1], [0, 2]] or lin.reg_bases[2] != [0, 4]:
        raise RuntimeError(f"nvfp4_gemv: unexpected mma operand layout {lin} (Triton version change?)")
    words = gl.DistributedLinearLayout(
        reg_bases=to_words(lin.reg_bases),
        lane_bases=to_words(lin.lane_bases),
        warp_bases=to_words(lin.warp_bases),
        block_bases=[],
        shape=[block_n, half // K_WIDTH, 2],
    )
    return mma, a, words, b


@functools.cache
def async_layouts(num_warps: int, block_t: int, token_warps: int = 1):
    """The cp.async kernel's layouts (128-wide K tiles): (mma, A dot, words [BN, 4, 2, 2], B dot, the copy
    layouts of the words [BN, 16] and of the scale bytes [BN, 8], the unswizzled shared layout).

    The words are the register layout of gemv_layouts with the run index split into (scale group, run in the
    group), so one [BN, 4] tensor of scale pairs broadcasts over the two runs of each group. The copy
    layouts spread the rows over all num_warps * token_warps warps (a warp past the rows repeats a copy)."""
    bn = 16 * num_warps
    warps = num_warps * token_warps
    mma, a, words, b = gemv_layouts(num_warps, bn, 128, block_t, token_warps)

    def split_run(bases: list[list[int]]) -> list[list[int]]:
        return [[r, run // 2, run % 2, w] for r, run, w in bases]

    w4 = gl.DistributedLinearLayout(
        reg_bases=split_run(words.reg_bases),
        lane_bases=split_run(words.lane_bases),
        warp_bases=split_run(words.warp_bases),
        block_bases=[],
        shape=[bn, 4, 2, 2],
    )
    lcw = gl.BlockedLayout([1, 4], [8, 4], [warps, 1], [1, 0])
    lcs = gl.BlockedLayout([1, 4], [16, 2], [warps, 1], [1, 0])
    smem = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    return mma, a, w4, b, lcw, lcs, smem


@functools.cache
def scale_word_layout(num_warps: int, block_t: int, token_warps: int = 1) -> gl.DistributedLinearLayout:
    """The tiled128 scale words [BN, 2] (TILED_SCALE_ORDER): word j of a row = the scale pairs of groups j and
    j + 2, held by the lanes that hold those groups in the [BN, 4] scale layout of the words (whose register
    basis for group + 2 is dropped here: the two groups come out of one word)."""
    bn = 16 * num_warps
    _, _, w4, _, _, _, _ = async_layouts(num_warps, block_t, token_warps)
    lg = _linear_bases(gl.SliceLayout(2, gl.SliceLayout(3, w4)), (bn, 4))
    if [0, 2] not in lg.reg_bases or any(c in (2, 3) for _, c in lg.lane_bases + lg.warp_bases):
        raise RuntimeError(f"nvfp4_gemv: unexpected scale layout {lg} (Triton version change?)")
    return gl.DistributedLinearLayout(
        reg_bases=[bs for bs in lg.reg_bases if bs != [0, 2]],
        lane_bases=lg.lane_bases,
        warp_bases=lg.warp_bases,
        block_bases=[],
        shape=[bn, 2],
    )


# (sm_89+) a run's two E4M3 scale bytes -> f16x2 in one cvt; bf16: the f16 bits >> 3 are the same values
# times 2^-112 as bf16 (E4M3 values are positive, normal in f16, with 7 zero low mantissa bits), and one
# exact multiply by 2^112 restores them
_SCALE_ASM = """
{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $1, $2, 0x0040;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
}
"""
_SCALE_ASM_BF16 = _SCALE_ASM.replace(
    "cvt.rn.f16x2.e4m3x2 $0, lo;", "cvt.rn.f16x2.e4m3x2 t, lo;\nshr.b32 t, t, 3;\nmul.rn.bf16x2 $0, t, $3;"
)  # $3: (2^112, 2^112) as bf16 bits (decode_table_words)
# the shift decoders' scales, s * 2^119 (bf16) / s * 2^7 (fp16), by an exponent add: E4M3 values are normal in
# f16 (and, >> 3, in bf16 times 2^-112), at most 448 (exponent + 231 <= 254 in bf16, + 7 <= 30 in f16). A zero
# scale becomes 2^104 / 2^-8, not 0: tile_split128 stores the codes of such groups as 0. One tiled128 scale
# word ($2: low g, high g, low g + 2, high g + 2; TILED_SCALE_ORDER) gives the pairs of groups g and g + 2.
# what the f16x2 bits of converted E4M3 scales get added to give the shift decoders' scale pairs: bf16 (after
# >> 3) s * 2^119, fp16 s * 2^7 (the exponent offsets, one per half)
BF16_SCALE_EXP_ADD = 0x73807380
FP16_SCALE_EXP_ADD = 0x1C001C00
_SCALE_WORD_ASM_BF16 = f"""
{{
.reg .b32 t;
.reg .b16 lo, hi;
mov.b32 {{lo, hi}}, $2;
cvt.rn.f16x2.e4m3x2 t, lo;
shr.b32 t, t, 3;
add.u32 $0, t, 0x{BF16_SCALE_EXP_ADD:08X};
cvt.rn.f16x2.e4m3x2 t, hi;
shr.b32 t, t, 3;
add.u32 $1, t, 0x{BF16_SCALE_EXP_ADD:08X};
}}
"""
_SCALE_WORD_ASM_FP16 = f"""
{{
.reg .b32 t;
.reg .b16 lo, hi;
mov.b32 {{lo, hi}}, $2;
cvt.rn.f16x2.e4m3x2 t, lo;
add.u32 $0, t, 0x{FP16_SCALE_EXP_ADD:08X};
cvt.rn.f16x2.e4m3x2 t, hi;
add.u32 $1, t, 0x{FP16_SCALE_EXP_ADD:08X};
}}
"""


@gluon.jit
def _halves(o):
    """uint32 pairs -> (low 16-bit float, high 16-bit float) as bf16 bit patterns."""
    lo = (o & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    hi = (o >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    return lo, hi


@gluon.jit
def _assemble(o_a, o_b, BN: gl.constexpr, HALF: gl.constexpr, LA: gl.constexpr, DT: gl.constexpr):
    """Decoded pairs [BN, RUNS, 2] (o_a: bytes 0, 1 of each word; o_b: bytes 2, 3) -> [BN, HALF] in LA."""
    a0, a1 = _halves(o_a)
    b0, b1 = _halves(o_b)
    even = gl.join(a0, b0)  # [BN, RUNS, 2 (word), 2 (pair)]: element 0 of each pair
    odd = gl.join(a1, b1)
    w = gl.reshape(gl.join(even, odd), [BN, HALF])  # k in the run = word * 4 + pair * 2 + element
    return gl.convert_layout(w.to(DT, bitcast=True), LA, assert_trivial=True)


@gluon.jit
def _x_tile_clamped(x_ptr, x_off, kx, k_start, kt, K: gl.constexpr, K_PAD: gl.constexpr):
    """The B operands of the K tile at kt, the token index already clamped into x: x columns of the low
    nibbles and of the high ones (64 further), masked only past K. x (a few KB, L1/L2-resident) is loaded
    when needed, not staged: it would double the registers."""
    if K == K_PAD:
        x_lo = gl.load(x_ptr + x_off + kt)
        x_hi = gl.load(x_ptr + x_off + (kt + 64))
    else:
        x_lo = gl.load(x_ptr + x_off + kt, mask=k_start + kt + kx < K, other=0.0)
        x_hi = gl.load(x_ptr + x_off + (kt + 64), mask=k_start + kt + kx + 64 < K, other=0.0)
    return x_lo, x_hi


@gluon.jit
def _gdc(ASM: gl.constexpr):
    """A grid-dependency-control instruction (programmatic dependent launch, sm_90+)."""
    gl.inline_asm_elementwise(ASM + " // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _scale_pair(s_lo, s_hi, c112, DT: gl.constexpr, SCALE_ASM: gl.constexpr):
    """E4M3 scale bytes of a run's low / high nibbles -> one word: (low scale, high scale) as DT bits."""
    if SCALE_ASM == "":
        sl = s_lo.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT).to(gl.uint16, bitcast=True)
        sh = s_hi.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(DT).to(gl.uint16, bitcast=True)
        return sl.to(gl.uint32) | (sh.to(gl.uint32) << 16)
    else:
        return gl.inline_asm_elementwise(
            asm=SCALE_ASM,
            constraints="=r,r,r,r",
            args=[s_lo.to(gl.uint32), s_hi.to(gl.uint32), c112],
            dtype=gl.uint32,
            is_pure=True,
            pack=1,
        )


@gluon.jit
def _load_tables(tab_ptr):
    """decode_table_words, loaded once per program so they stay in registers (as immediates, ptxas
    re-materialised them before every use)."""
    return (gl.load(tab_ptr), gl.load(tab_ptr + 1), gl.load(tab_ptr + 2), gl.load(tab_ptr + 3),
            gl.load(tab_ptr + 4))  # fmt: skip


@gluon.jit
def _decode_operands(
    p, s_pair, tab, BN: gl.constexpr, HALF: gl.constexpr, ASM: gl.constexpr, LA: gl.constexpr,
    DT: gl.constexpr,
):  # fmt: skip
    """decode(words p, scales s_pair broadcast over p) -> the mma A operands of the low- and high-nibble
    halves, in registers (no data movement: `_assemble`)."""
    o_la, o_lb, o_ha, o_hb = gl.inline_asm_elementwise(
        asm=ASM,
        constraints="=r,=r,=r,=r,r,r,r,r,r,r",
        args=[p.to(gl.uint32, bitcast=True), s_pair, tab[0], tab[1], tab[2], tab[3]],
        dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32),
        is_pure=True,
        pack=1,
    )
    RUNS: gl.constexpr = HALF // 8
    o_la = gl.reshape(o_la, [BN, RUNS, 2])
    o_lb = gl.reshape(o_lb, [BN, RUNS, 2])
    o_ha = gl.reshape(o_ha, [BN, RUNS, 2])
    o_hb = gl.reshape(o_hb, [BN, RUNS, 2])
    return _assemble(o_la, o_lb, BN, HALF, LA, DT), _assemble(o_ha, o_hb, BN, HALF, LA, DT)


@gluon.jit
def _mma_words(
    acc, p, s_pair, tab, x_lo, x_hi, BN: gl.constexpr, HALF: gl.constexpr, ASM: gl.constexpr,
    LA: gl.constexpr, DT: gl.constexpr,
):  # fmt: skip
    """acc += decode(words p, scales s_pair broadcast over p) @ x: two mma_v2 (low / high-nibble halves)."""
    a_lo, a_hi = _decode_operands(p, s_pair, tab, BN, HALF, ASM, LA, DT)
    acc = mma_v2(a_lo, x_lo, acc)
    return mma_v2(a_hi, x_hi, acc)


@gluon.jit
def _issue_tile(
    smem_w, smem_s, w_src, s_src, ok_w, ok_s, tile, N_TILES: gl.constexpr, BK: gl.constexpr,
    TILED: gl.constexpr, IN_RANGE: gl.constexpr = False,
):  # fmt: skip
    """cp.async the words and scale bytes of K tile `tile` into one pipeline slot (zeros past the end;
    IN_RANGE: the caller knows tile < N_TILES)."""
    more = True if IN_RANGE else tile < N_TILES
    if TILED:  # consecutive K tiles of a 16-row block are consecutive 1 KB + 128 B blocks (int32 pointers)
        _async_load(smem_w, w_src + tile * 256, mask=ok_w & more)
        _async_load(smem_s, s_src + tile * 32, mask=ok_s & more)
    else:
        kt = tile * BK
        _async_load(smem_w, w_src + kt // 8, mask=ok_w & more)
        _async_load(smem_s, s_src + kt // 16, mask=ok_s & more)
    async_copy.commit_group()


@gluon.jit
def _async_step(
    acc, i, x_ptr, x_off, kx, k_start, smem_w, smem_s, w_src, s_src, ok_w, ok_s, tab,
    K: gl.constexpr, K_PAD: gl.constexpr, N_TILES: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr,
    HALF: gl.constexpr, STAGES: gl.constexpr, TILED: gl.constexpr, ASM: gl.constexpr,
    SCALE_ASM: gl.constexpr, LA: gl.constexpr, LW4: gl.constexpr, L_G: gl.constexpr, DT: gl.constexpr,
    SMEM: gl.constexpr, LSW: gl.constexpr, ISSUE: gl.constexpr = True,
):  # fmt: skip
    """One K tile of the cp.async kernel: wait for its slot, refill the slot STAGES - 1 tiles ahead (ISSUE:
    the caller's loop only runs while that tile exists), decode, two mma."""
    kt = i * BK
    x_lo, x_hi = _x_tile_clamped(x_ptr, x_off, kx, k_start, kt, K, K_PAD)
    if ISSUE:
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
    else:
        async_copy.wait_group(0)  # no newer group follows: all of this thread's copies
    _cta_barrier()  # ... and everyone's; the slot refilled below was read by everyone last iteration
    if ISSUE:
        nxt = i + STAGES - 1
        _issue_tile(smem_w.index(nxt % STAGES), smem_s.index(nxt % STAGES), w_src, s_src, ok_w, ok_s, nxt,
                    N_TILES, BK, TILED, True)  # fmt: skip
    slot = i % STAGES
    return _consume_slot(acc, smem_w.index(slot), smem_s.index(slot), tab, x_lo, x_hi, BN, HALF, TILED, ASM,
                         SCALE_ASM, LA, LW4, L_G, DT, LSW)  # fmt: skip


@gluon.jit
def _consume_slot(
    acc, slot_w, slot_s, tab, x_lo, x_hi, BN: gl.constexpr, HALF: gl.constexpr, TILED: gl.constexpr,
    ASM: gl.constexpr, SCALE_ASM: gl.constexpr, LA: gl.constexpr, LW4: gl.constexpr, L_G: gl.constexpr,
    DT: gl.constexpr, LSW: gl.constexpr,
):  # fmt: skip
    """acc += the K tile staged in one ring slot (words slot_w [BN, 16], scales slot_s) times x's tile:
    the scales to packed 16-bit pairs, the words decoded in registers, two mma."""
    p = slot_w.reshape([BN, 4, 2, 2]).load(LW4)
    sw = slot_s
    if TILED:  # one word per row and lane: the pairs of groups j and j + 2 (TILED_SCALE_ORDER)
        s_w = sw.load(LSW)
        s_a, s_b = gl.inline_asm_elementwise(
            asm=SCALE_ASM, constraints="=r,=r,r", args=[s_w.to(gl.uint32, bitcast=True)],
            dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1,
        )  # fmt: skip
        s_pair = gl.reshape(gl.permute(gl.join(s_a, s_b), [0, 2, 1]), [BN, 4])  # group = 2 * (b) + j
        s_pair = gl.convert_layout(s_pair, L_G, assert_trivial=True)
    else:
        s_lo = sw.slice(0, 4, 1).load(L_G)
        s_pair = _scale_pair(s_lo, sw.slice(4, 4, 1).load(L_G), tab[4], DT, SCALE_ASM)
    s_pair = gl.expand_dims(gl.expand_dims(s_pair, 2), 3)
    return _mma_words(acc, p, s_pair, tab, x_lo, x_hi, BN, HALF, ASM, LA, DT)


@gluon.jit
def _nvfp4_gemv_async_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, tab_ptr, M, N, stride_xm, stride_ym,
    K: gl.constexpr, K_PAD: gl.constexpr, SPLIT_K: gl.constexpr, PER_COL_GS: gl.constexpr,
    HAS_BIAS: gl.constexpr, EVEN_N: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
    ASM: gl.constexpr, SCALE_ASM: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LW4: gl.constexpr,
    LB: gl.constexpr, LCW: gl.constexpr, LCS: gl.constexpr, SMEM: gl.constexpr, TILED: gl.constexpr,
    OUT_SCALE: gl.constexpr, PDL: gl.constexpr = False, LSW: gl.constexpr = None, ids_ptr=None, n_experts=0,
    slot_div=1, w_estride=0, s_estride=0, gs_estride=0, GROUPED: gl.constexpr = False, grp_ptr=None,
    BYEXP: gl.constexpr = False, ACT: gl.constexpr = 0, act_beta=1.0, act_rbeta=1.0, act_lbeta=1.0,
    act_rlbeta=1.0, half_n=0, EARLY: gl.constexpr = False,
):  # fmt: skip
    """The decode GEMM with the weights and scales staged through shared memory by cp.async: STAGES - 1
    K tiles (128 wide) in flight per warp without holding registers.
    GROUPED (`nvfp4_gemv_grouped`): grid axis 2 is the pick s: one token row x[s // slot_div] times expert
    ids[s]'s weights (w / s / gs_ptr + ids[s] * their expert strides) into y row s; an id outside
    [0, n_experts) copies no weights (zero-filled: y row s = 0).
    BYEXP (`nvfp4_gemv_by_expert`, with GROUPED): grid axis 2 is a group g of the table grp [G, 1 + BT]
    (`expert_groups`): expert grp[g, 0] (-1: an unused group, whose programs return at once) times the
    token rows x[grp[g, 1 + t] // slot_div] of its picks (-1 pads the columns past the group's count) into
    y rows grp[g, 1 + t]: each expert's weights are read once for all its tokens.
    ACT (an expert's GEMM1 with its gated activation, `_ACT_CODES`; 16-row programs): program b reads gate
    rows 8b..8b+7 and the matching up rows half_n + 8b.. as its 16 rows, and its epilogue writes
    h = act(gate, up) into y's columns 8b..8b+7 (y [.., half_n]): rows r and r + 8 of the accumulator.
    EARLY (with GROUPED and PDL): the ids / table were written before the previous launch, so they are read,
    and the first weight tiles staged, before the PDL wait, which then guards x (as in the dense form)."""
    BK: gl.constexpr = 128
    HALF: gl.constexpr = 64
    K_SPLIT: gl.constexpr = K_PAD // SPLIT_K
    N_TILES: gl.constexpr = K_SPLIT // BK
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    hit = True
    if GROUPED:
        if PDL and not EARLY:  # the ids are the previous kernel's output (routing): wait before reading them
            _gdc("griddepcontrol.wait;")
        pid_s = gl.program_id(2)
        if BYEXP:
            grp_ptr += pid_s * (BT + 1)
            e = gl.load(grp_ptr).to(gl.int32)
            if e < 0:  # an unused group: nothing to read or write
                return
            # the group's token count: its picks fill columns 0 .. M - 1
            cols = gl.arange(0, BT, layout=gl.SliceLayout(0, LB))
            M = gl.sum((gl.load(grp_ptr + 1 + cols) >= 0).to(gl.int32), axis=0)
        else:
            e = gl.load(ids_ptr + pid_s).to(gl.int32)
            hit = (e >= 0) & (e < n_experts)
            e = gl.where(hit, e, 0)
            x_ptr += (pid_s // slot_div).to(gl.int64) * stride_xm
            y_ptr += pid_s.to(gl.int64) * stride_ym
        e = e.to(gl.int64)
        w_ptr += e * w_estride
        s_ptr += e * s_estride
        gs_ptr += e * gs_estride
        ws_ptr += pid_s.to(gl.int64) * (SPLIT_K * gl.num_programs(0) * BN * BT)
        cnt_ptr += pid_s * gl.num_programs(0)
    k_start = pid_k * K_SPLIT
    tab = _load_tables(tab_ptr)

    # ---- copy sources: words [BN, 16] (16-byte cp.async per thread) and scale bytes [BN, 8] (4 bytes)
    rw = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LCW))
    if ACT:
        rw = _act_rows(rw, half_n)
    cw = gl.arange(0, 16, layout=gl.SliceLayout(0, LCW))
    rw2 = gl.expand_dims(rw, 1)
    CH: gl.constexpr = K_PAD // 128
    if TILED:  # tile_split128 layout: [rows / 16, K_PAD / 128, 16 rows, 16 words]
        w_row = ((rw2 // 16).to(gl.int64) * CH + k_start // 128) * 16 + rw2 % 16
        w_src = w_ptr + (w_row * 16 + gl.expand_dims(cw, 0))
    else:
        w_src = w_ptr + (rw2.to(gl.int64) * (K_PAD // 8) + k_start // 8 + gl.expand_dims(cw, 0))
    # scales: tiled128 as int32 words [BN, 2] (s_ptr is an int32 pointer there), split128 as bytes [BN, 8]
    LCS_: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [gl.num_warps(), 1], [1, 0]) if TILED else LCS
    SW: gl.constexpr = 2 if TILED else 8
    rs = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LCS_))
    if ACT:
        rs = _act_rows(rs, half_n)
    cs = gl.arange(0, SW, layout=gl.SliceLayout(0, LCS_))
    rs2 = gl.expand_dims(rs, 1)
    if TILED:  # [rows / 16, K_PAD / 128, 16 rows, 2 words of 4 scales]
        s_row = ((rs2 // 16).to(gl.int64) * CH + k_start // 128) * 16 + rs2 % 16
        s_src = s_ptr + (s_row * 2 + gl.expand_dims(cs, 0))
    else:
        s_src = s_ptr + (rs2.to(gl.int64) * (K_PAD // 16) + k_start // 16 + gl.expand_dims(cs, 0))
    if EVEN_N:
        ok_w = gl.full([BN, 16], 1, gl.int1, layout=LCW)
        ok_s = gl.full([BN, SW], 1, gl.int1, layout=LCS_)
    else:
        ok_w = (rw2 < N) & (gl.expand_dims(cw, 0) >= 0)
        ok_s = (rs2 < N) & (gl.expand_dims(cs, 0) >= 0)
    if GROUPED:  # a missed pick copies nothing: zero codes decode to 0 whatever the scale
        ok_w = ok_w & hit
        ok_s = ok_s & hit
    smem_w = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 16], SMEM)
    smem_s = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES, BN, SW], SMEM)

    # ---- B side [HALF, BT]: x columns of the low nibbles (the high nibbles' are 64 further)
    j = gl.arange(0, HALF, layout=gl.SliceLayout(1, LB))
    t = gl.arange(0, BT, layout=gl.SliceLayout(0, LB))
    kx = gl.expand_dims(j, 1)  # [HALF, 1]
    t2 = gl.expand_dims(t, 0)  # [1, BT]
    # token columns >= M re-read row M - 1 (never stored): no token mask, no zero-fill of the B operand
    if BYEXP:  # column t is the token of the group's pick t
        xrow = gl.load(grp_ptr + 1 + gl.minimum(t2, M - 1)) // slot_div
        x_off = xrow.to(gl.int64) * stride_xm + k_start + kx
    else:
        x_off = gl.minimum(t2, M - 1).to(gl.int64) * stride_xm + k_start + kx
    L_G: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, LW4))  # [BN, 4]: one scale group per 2 runs

    for st in gl.static_range(STAGES - 1):
        _issue_tile(smem_w.index(st), smem_s.index(st), w_src, s_src, ok_w, ok_s, st, N_TILES, BK, TILED)
    if PDL and (EARLY or not GROUPED):  # x (and ws, the counters, y) may be the previous launch's: wait
        _gdc("griddepcontrol.wait;")
    acc = gl.zeros([BN, BT], gl.float32, layout=MMA)
    # the loop is split where the refills stop, so neither part tests whether a tile exists
    MAIN: gl.constexpr = N_TILES - (STAGES - 1) if N_TILES >= STAGES - 1 else 0
    for i in range(MAIN):
        acc = _async_step(
            acc, i, x_ptr, x_off, kx, k_start, smem_w, smem_s, w_src, s_src, ok_w, ok_s, tab, K, K_PAD,
            N_TILES, BK, BN, HALF, STAGES, TILED, ASM, SCALE_ASM, LA, LW4, L_G, DT, SMEM, LSW, True,
        )  # fmt: skip
    for i in range(MAIN, N_TILES):
        acc = _async_step(
            acc, i, x_ptr, x_off, kx, k_start, smem_w, smem_s, w_src, s_src, ok_w, ok_s, tab, K, K_PAD,
            N_TILES, BK, BN, HALF, STAGES, TILED, ASM, SCALE_ASM, LA, LW4, L_G, DT, SMEM, LSW, False,
        )  # fmt: skip
    if PDL:  # the next launch may start now (its prologue overlaps this one's split-K reduction)
        _gdc("griddepcontrol.launch_dependents;")
    async_copy.wait_group(0)
    if OUT_SCALE != 1.0:
        acc = acc * OUT_SCALE

    _epilogue(acc, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, pid_n, pid_k, SPLIT_K, PER_COL_GS,
              HAS_BIAS, BN, BT, MMA, grp_ptr, BYEXP, ACT, act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n,
              SMEM)  # fmt: skip


@gluon.jit
def _epilogue(
    acc, gs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, pid_n, pid_k, SPLIT_K: gl.constexpr,
    PER_COL_GS: gl.constexpr, HAS_BIAS: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, MMA: gl.constexpr,
    grp_ptr=None, BYEXP: gl.constexpr = False, ACT: gl.constexpr = 0, act_beta=1.0, act_rbeta=1.0,
    act_lbeta=1.0, act_rlbeta=1.0, half_n=0, SMEM: gl.constexpr = None,
):  # fmt: skip
    """acc[n, t] -> y[t, n] (BYEXP: y[grp[1 + t], n]); with split-K the last program of the row block to
    arrive sums the partials. ACT: the gated activation of the gate / up row pairs (`_finish_act`)."""
    n_idx = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    t_idx = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    n2 = gl.expand_dims(n_idx, 1)
    te = gl.expand_dims(t_idx, 0)
    out_ok = (n2 < N) & (te < M)
    yrow = te
    if BYEXP:
        yrow = gl.load(grp_ptr + 1 + gl.minimum(te, M - 1))
    if SPLIT_K > 1:
        ws_off = (pid_k * (gl.num_programs(0) * BN) + n2).to(gl.int64) * BT + te
        gl.store(ws_ptr + ws_off, acc, mask=te < M)  # only the real tokens' partials travel
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = gl.zeros([BN, BT], gl.float32, layout=MMA)
            for sk in gl.static_range(SPLIT_K):
                part_off = (sk * (gl.num_programs(0) * BN) + n2).to(gl.int64) * BT + te
                acc += gl.load(ws_ptr + part_off, mask=te < M, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            _store(
                acc, gs_ptr, b_ptr, y_ptr, pid_n, n_idx, n2, yrow, out_ok, stride_ym, M, N, PER_COL_GS,
                HAS_BIAS, BN, BT, grp_ptr, BYEXP, ACT, act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n,
                SMEM,
            )  # fmt: skip
    else:
        _store(
            acc, gs_ptr, b_ptr, y_ptr, pid_n, n_idx, n2, yrow, out_ok, stride_ym, M, N, PER_COL_GS, HAS_BIAS,
            BN, BT, grp_ptr, BYEXP, ACT, act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n, SMEM,
        )  # fmt: skip


@gluon.jit
def _store(
    acc, gs_ptr, b_ptr, y_ptr, pid_n, n_idx, n2, yrow, out_ok, stride_ym, M, N, PER_COL_GS: gl.constexpr,
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, grp_ptr, BYEXP: gl.constexpr,
    ACT: gl.constexpr, act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n, SMEM: gl.constexpr,
):  # fmt: skip
    if ACT:
        _finish_act(acc, gs_ptr, y_ptr, pid_n, n_idx, stride_ym, M, PER_COL_GS, BN, BT, grp_ptr, BYEXP, ACT,
                    act_beta, act_rbeta, act_lbeta, act_rlbeta, half_n, SMEM)  # fmt: skip
    else:
        _finish(acc, gs_ptr, b_ptr, y_ptr, n_idx, n2, yrow, out_ok, stride_ym, PER_COL_GS, HAS_BIAS, N)


@gluon.jit
def _finish(
    acc,
    gs_ptr,
    b_ptr,
    y_ptr,
    n_idx,
    n2,
    yrow,
    out_ok,
    stride_ym,
    PER_COL_GS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    N,
):
    n_ok = n_idx < N
    if PER_COL_GS:
        acc = acc * gl.expand_dims(gl.load(gs_ptr + n_idx, mask=n_ok, other=0.0), 1)
    else:
        acc = acc * gl.load(gs_ptr)
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(b_ptr + n_idx, mask=n_ok, other=0.0).to(gl.float32), 1)
    gl.store(y_ptr + yrow.to(gl.int64) * stride_ym + n2, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


# the activations GEMM1's epilogue applies (ACT): SiLU, SiTU, SiTU with the up half capped (linear_beta)
_ACT_CODES = {("silu", False): 1, ("situ", False): 2, ("situ", True): 3}
GateAct = tuple[str, float, float | None]  # (kind, beta, linear_beta) as GatedActivation holds them


def _act_args(act: GateAct | None, rows: int) -> dict:
    """The kernel arguments of GEMM1 with its activation (none without `act`); rows: 2I, gate then up."""
    if act is None:
        return {}
    kind, beta, lbeta = act
    code = _ACT_CODES.get((kind, lbeta is not None))
    if code is None:
        raise ValueError(f"nvfp4 grouped: no epilogue activation {kind!r}; expected silu or situ")
    if rows % 16:
        raise ValueError(f"nvfp4 grouped: the epilogue activation needs 2I a multiple of 16, got {rows}")
    from k3run.kernels.moe_ops.triton import _f32_reciprocal  # the gated kernel's reciprocals, bit for bit

    b = float(beta) if kind == "situ" else 1.0
    lb = float(lbeta) if lbeta is not None else 1.0
    rb, rlb = _f32_reciprocal(b), _f32_reciprocal(lb)
    return dict(ACT=code, act_beta=b, act_rbeta=rb, act_lbeta=lb, act_rlbeta=rlb, half_n=rows // 2)


@gluon.jit
def _act_rows(r, half_n):
    """The weight rows an ACT program's 16 rows hold: gate rows 8b..8b+7 for block b's first 8, the up rows
    half_n + 8b.. for its last 8."""
    j = r % 16
    return (r // 16) * 8 + j % 8 + (j // 8) * half_n


@gluon.jit
def _tanh_g(x):
    x2 = x * x  # small |x|: the series to x^9 (the exp formula cancels there)
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return gl.where(gl.abs(x) < 0.2, series, 1.0 - 2.0 / (gl.exp(2.0 * x) + 1.0))


@gluon.jit
def _finish_act(
    acc, gs_ptr, y_ptr, pid_n, n_idx, stride_ym, M, PER_COL_GS: gl.constexpr, BN: gl.constexpr,
    BT: gl.constexpr, grp_ptr, BYEXP: gl.constexpr, ACT: gl.constexpr, beta, rbeta, lbeta, rlbeta, half_n,
    SMEM: gl.constexpr, buf=None,
):  # fmt: skip
    """GEMM1's epilogue with the gated activation: gate and up scaled by their rows' decode scales and
    rounded to y's dtype (what GEMM1 stores on the separate path), through shared memory so that gate row j
    meets up row j + 8, then h = act(gate, up) in fp32 (moe_ops' gated kernel's formulas), rounded, into
    y[token, 8 * pid_n + j]. buf: the [BN, BT] shared buffer, allocated here unless the caller (a loop over
    several epilogues) passes its own."""
    rows = _act_rows(n_idx, half_n)
    if PER_COL_GS:
        acc = acc * gl.expand_dims(gl.load(gs_ptr + rows), 1)
    else:
        acc = acc * gl.load(gs_ptr)
    if buf is None:
        buf = gl.allocate_shared_memory(y_ptr.dtype.element_ty, [BN, BT], SMEM)
    buf.store(acc.to(y_ptr.dtype.element_ty))
    _cta_barrier()
    LH: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [gl.num_warps(), 1], [1, 0])
    g = buf.slice(0, 8, 0).load(LH).to(gl.float32)
    u = buf.slice(8, 8, 0).load(LH).to(gl.float32)
    sig = 1.0 / (1.0 + gl.exp(-g))
    if ACT == 1:
        h = g * sig * u
    else:
        if ACT == 3:
            u = lbeta * _tanh_g(u * rlbeta)
        h = beta * _tanh_g(g * rbeta) * sig * u
    c = gl.expand_dims(pid_n * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, LH)), 1)
    te = gl.expand_dims(gl.arange(0, BT, layout=gl.SliceLayout(0, LH)), 0)
    yrow = te
    if BYEXP:
        yrow = gl.load(grp_ptr + 1 + gl.minimum(te, M - 1))
    gl.store(
        y_ptr + yrow.to(gl.int64) * stride_ym + c, h.to(y_ptr.dtype.element_ty), mask=(te < M) & (c < half_n)
    )


MAXNREG = {8: 168, 16: 192, 32: 232}  # ptxas register cap per token tile (see nvfp4_gemv)


def token_tile(m: int) -> int:
    """The decode kernel's token tile (the mma n dimension) for a launch of m <= 32 rows: 8, 16 or 32."""
    return 8 if m <= 8 else 16 if m <= 16 else 32


def _gemv_checks(
    x: torch.Tensor, weight: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, stages: int, tiled: bool, rows: int | None, pdl: bool | None,
) -> tuple[int, bool, bool]:  # fmt: skip
    """nvfp4_gemv's operand checks: (N, whether the GPU is sm_89+, pdl resolved for it)."""
    from k3run.kernels.nvfp4_gemm.triton import _check

    n = _check(x, weight, scale_u8, global_scale, x.shape[-1], None if tiled else bias)
    # sm_89+: cvt.f16x2.e4m3x2 converts a run's two scale bytes in one instruction
    cap = torch.cuda.get_device_capability(x.device)
    sm89 = cap >= (8, 9)
    if pdl is None:
        pdl = cap >= (9, 0)
    elif pdl and cap < (9, 0):
        raise ValueError("nvfp4_gemv: pdl needs sm_90+")
    if tiled:
        if n % 16 or (rows is not None and not n - 16 < rows <= n):
            raise ValueError(f"nvfp4_gemv: a tiled weight has rows padded to 16: {n} rows for N={rows}")
        if not sm89:
            raise ValueError("nvfp4_gemv: the tiled layout's decoder needs sm_89+ (cvt from E4M3)")
        n = n if rows is None else rows
        if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"nvfp4 bias: expected contiguous [{n}], got {tuple(bias.shape)}")
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_gemv: needs bf16/fp16 input on CUDA, got {x.dtype} on {x.device}")
    if x.shape[0] > 32:
        raise ValueError(f"nvfp4_gemv: M={x.shape[0]} > 32 (split the rows, or use the tiled GEMM)")
    if stages < 2:
        raise ValueError(f"nvfp4_gemv: stages={stages}, expected >= 2 shared-memory slots")
    return n, sm89, pdl


def nvfp4_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_warps: int = 1,
    split_k: int = 1,
    stages: int = 2,
    maxnreg: int | None = None,
    tiled: bool = False,
    rows: int | None = None,
    pdl: bool | None = None,
    token_warps: int = 1,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T * global_scale (+ bias) for M <= 32, bf16/fp16 x on CUDA (sm_80+).

    weight / scale_u8: the split128 layout (`repack_split128`), or with `tiled` the `tile_split128` layout
    (sm_89+), whose rows are padded to 16; rows: the real row count N then. One program covers 16 *
    num_warps rows and K_pad / split_k columns in 128-wide tiles, `stages` (>= 2) shared-memory slots
    (stages - 1 tiles in flight). The token tile is 8, 16 or 32 wide (the mma n dimension), the smallest
    that holds M.
    maxnreg: the register cap handed to ptxas; None: MAXNREG of the token tile.
    token_warps (1, 2 or 4; at least 8 token columns each): warps a program that split the token tile's
    columns, each decoding the same 16 * num_warps weight rows from the shared-memory slots into its own
    mma operands. The weights are read from memory once a program either way; a warp then holds the
    registers of a token tile token_warps times narrower, so more warps fit an SM.
    pdl: programmatic dependent launch. The launch may start while the previous kernel on the stream
    drains: its programs stage their first weight tiles, then wait (griddepcontrol.wait) for the previous
    kernel to finish before reading x or writing anything; and once every program of this launch has left
    its K loop, the next launch may start (its prologue overlaps this one's split-K reduction). Weights,
    scales and tables are read before the wait, so they must not be written by the kernel just before.
    None: on where supported (sm_90+): 1.0-1.1 us less per back-to-back launch at M = 1 (H200,
    bench/RESULTS.md).
    """
    from k3run.kernels.nvfp4_gemm.triton import largest_divisor

    n, sm89, pdl = _gemv_checks(x, weight, scale_u8, global_scale, bias, stages, tiled, rows, pdl)
    m, k = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    k_pad = weight.shape[1] * 2
    split_k = largest_divisor(k_pad // CHUNK, split_k)
    bt = token_tile(m)
    if token_warps not in (1, 2, 4) or bt // token_warps < 8:
        raise ValueError(
            f"nvfp4_gemv: token_warps must be 1, 2 or 4 with >= 8 token columns a warp; got {token_warps} "
            f"for the {bt}-token tile (M={m})"
        )
    grid_n = triton.cdiv(n, 16 * num_warps)
    if split_k > 1:
        ws = torch.empty((split_k, grid_n * 16 * num_warps, bt), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, grid_n)
    else:
        ws = cnt = y
    scales = scale_u8.view(torch.int32) if tiled else scale_u8  # tiled128: one word per 4 scale bytes
    common = (x, weight.view(torch.int32), scales, global_scale, bias if bias is not None else global_scale)
    per_col = global_scale.numel() != 1  # _check: one global scale or one per row
    _launch_async(
        (grid_n, split_k), common, y, ws, cnt, m, n, k, k_pad, split_k, num_warps, bt, stages, tiled, sm89,
        pdl, maxnreg, per_col, bias is not None, token_warps=token_warps,
    )  # fmt: skip
    return y


def _check_grouped_operands(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    rows: int,
    pdl: bool | None,
) -> tuple[int, bool]:
    """Checks the stacked tiled128 experts, the input and the GPU of a grouped launch (a ValueError naming
    the operand, what was expected and what came); returns the number of experts E and whether to use
    programmatic dependent launch (`pdl`, or by default on sm_90+)."""
    if weight.dim() != 3 or weight.dtype != torch.uint8 or not weight.is_contiguous():
        raise ValueError(
            f"nvfp4 grouped weight: expected contiguous uint8 [E, N_pad, K_pad/2], got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    n_exp, n_pad, k_pad = weight.shape[0], weight.shape[1], weight.shape[2] * 2
    if tuple(scale_u8.shape) != (n_exp, n_pad, k_pad // 16) or scale_u8.dtype != torch.uint8:
        raise ValueError(
            f"nvfp4 grouped weight_scale: expected uint8 {(n_exp, n_pad, k_pad // 16)}, got {scale_u8.dtype} "
            f"{tuple(scale_u8.shape)}"
        )
    if not scale_u8.is_contiguous():
        raise ValueError("nvfp4 grouped weight_scale: must be contiguous")
    if global_scale.dtype != torch.float32 or tuple(global_scale.shape) not in ((n_exp, n_pad), (n_exp, 1)):
        raise ValueError(
            f"nvfp4 grouped global scale: expected fp32 [{n_exp}, {n_pad}] or [{n_exp}, 1], got "
            f"{global_scale.dtype} {tuple(global_scale.shape)}"
        )
    if not global_scale.is_contiguous():
        raise ValueError("nvfp4 grouped global scale: must be contiguous")
    if n_pad % 16 or not n_pad - 16 < rows <= n_pad:
        raise ValueError(f"nvfp4 grouped: a tiled weight has rows padded to 16: {n_pad} rows for N={rows}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda or x.stride(1) != 1:
        raise ValueError(
            f"nvfp4 grouped input: expected bf16/fp16 [T, K] on CUDA with unit stride along K, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    k = x.shape[1]
    if k % 16 or not k_pad - CHUNK < k <= k_pad:
        raise ValueError(f"nvfp4 grouped: input K={k} does not round up to the weight's width {k_pad}")
    cap = torch.cuda.get_device_capability(x.device)
    if cap < (8, 9):
        raise ValueError("nvfp4 grouped: the tiled layout's decoder needs sm_89+ (cvt from E4M3)")
    return n_exp, cap >= (9, 0) if pdl is None else pdl


def check_picks(x: torch.Tensor, ids: torch.Tensor) -> tuple[int, int]:
    """The per-pick launches' ids: int32/int64 [P] on x's device, P a multiple of x's T rows; (P, T)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != x.device:
        raise ValueError(f"nvfp4 grouped ids: expected int32/int64 [P] on {x.device}, got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device}")  # fmt: skip
    picks, t = ids.shape[0], x.shape[0]
    if t == 0 or picks % t:
        raise ValueError(f"nvfp4 grouped: {picks} picks for {t} tokens (expected a multiple)")
    return picks, t


def nvfp4_gemv_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    ids: torch.Tensor,
    *,
    rows: int,
    split_k: int = 1,
    maxnreg: int | None = None,
    pdl: bool | None = None,
    act: GateAct | None = None,
    early_ids: bool = False,
) -> torch.Tensor:
    """Routed experts in one launch: y [P, N], row s = x[s // (P / T)] @ W[ids[s]]^T * global_scale[ids[s]];
    with `act` (GEMM1 of gated experts: gate rows then up rows) h [P, N / 2] = act(gate, up) instead.

    x [T, K] bf16/fp16; weight / scale_u8: E experts in the tiled128 layout ([E, N_pad, K_pad / 2] and
    [E, N_pad, K_pad / 16] uint8, rows padded to 16; `rows` = N); global_scale fp32 [E, N_pad] (per row) or
    [E, 1]; ids [P] int32/int64 local expert indices, P a multiple of T (the picks of each token in order).
    An id outside [0, E) (another rank's expert) gives a zero row, read no weights, and needs no host check,
    so the launch can be captured in a CUDA graph. Each pick is one token through the cp.async kernel
    (8-token tile, split_k programs per 16 rows); PDL (default on sm_90+) waits before reading ids, or
    after with `early_ids` (as `nvfp4_gemv_by_expert`'s early_table).
    """
    n_exp, pdl = _check_grouped_operands(x, weight, scale_u8, global_scale, rows, pdl)
    picks, t = check_picks(x, ids)
    act_kw = _act_args(act, rows)
    y = torch.empty((picks, rows // 2 if act else rows), dtype=x.dtype, device=x.device)
    if picks == 0:
        return y
    _launch_grouped(x, weight, scale_u8, global_scale, y, picks, 8, 1, split_k, maxnreg, pdl, ids_ptr=ids,
                    n_experts=n_exp, slot_div=picks // t, n=rows, EARLY=early_ids, **act_kw)  # fmt: skip
    return y


def by_expert_output(
    x: torch.Tensor, picks: int, slot_div: int, rows: int, act: bool, all_in_groups: bool
) -> torch.Tensor:
    """The by-expert launches' output y [picks, rows (act: rows / 2)], zeroed unless every pick is in a group
    (the rows of missed picks stay zero), after checking that the picks fit x's rows at slot_div a row."""
    if slot_div < 1 or picks > x.shape[0] * slot_div:
        raise ValueError(f"nvfp4 by-expert: {picks} picks over {x.shape[0]} rows of x at {slot_div} per row")
    new = torch.empty if all_in_groups else torch.zeros
    return new((picks, rows // 2 if act else rows), dtype=x.dtype, device=x.device)


def nvfp4_gemv_by_expert(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    groups: torch.Tensor,
    *,
    picks: int,
    slot_div: int,
    rows: int,
    split_k: int = 1,
    maxnreg: int | None = None,
    pdl: bool | None = None,
    all_in_groups: bool = False,
    act: GateAct | None = None,
    early_table: bool = False,
    stages: int = 2,
    programs: int | None = None,
) -> torch.Tensor:
    """Routed experts in one launch, expert-major: y [picks, N], row s = x[s // slot_div] @ W[e(s)]^T *
    global_scale[e(s)] for the picks s in the group table `groups` ([G, 1 + BT] int32 from `expert_groups`, BT
    is 8, 16 or 32: expert per group, then its picks), zero for the picks in no group (other ranks' experts).
    all_in_groups: the caller knows every pick is in a group (no expert parallelism), so every row is
    written and y needs no zero fill (one memset fewer a call). act: as in `nvfp4_gemv_grouped`.
    One program per (16 rows, K split, group) runs the BT-token tile over the group's tokens, so each picked
    expert's weights are read once per launch however many tokens picked it (the per-pick `nvfp4_gemv_grouped`
    reads them once per pick). Each column of the tile is computed exactly as the one-token launch computes
    it, so the two agree bit for bit. Unused groups return at once; no host synchronisation
    (graph-capturable); PDL (default on sm_90+) waits before reading the table, or with `early_table` (the
    table was written before the launch just before this one, as for GEMM2 after GEMM1: every kernel of the
    step waits for its predecessor before it lets the next one launch, so the table is complete when this
    launch starts) reads it and stages the first weight tiles before the wait, which then guards x only.
    stages: the shared-memory slots of each program's weight ring (>= 2; tiles in flight = stages - 1).
    programs: the stream-K form instead (`expert_stream.py`): that many 1-warp programs share the launch's K
    tiles evenly, the same result up to the fp32 sum of an item split between two of them; split_k and
    maxnreg do not apply.
    x [T, K], weights and scales as in `nvfp4_gemv_grouped`."""
    n_exp, pdl = _check_grouped_operands(x, weight, scale_u8, global_scale, rows, pdl)
    if groups.dim() != 2 or groups.dtype != torch.int32 or groups.shape[1] - 1 not in (8, 16, 32):
        raise ValueError(
            f"nvfp4 by-expert groups: expected int32 [G, 9], [G, 17] or [G, 33] (expert_groups), got "
            f"{groups.dtype} {tuple(groups.shape)}"
        )
    if not groups.is_contiguous() or groups.device != x.device:
        raise ValueError(f"nvfp4 by-expert groups: must be contiguous on {x.device}")
    if stages < 2:
        raise ValueError(f"nvfp4 by-expert: stages must be >= 2 (a ring of slots), got {stages}")
    if programs is not None and programs < 1:
        raise ValueError(f"nvfp4 by-expert stream: programs must be >= 1, got {programs}")
    act_kw = _act_args(act, rows)
    y = by_expert_output(x, picks, slot_div, rows, act is not None, all_in_groups)
    n_groups, bt = groups.shape[0], groups.shape[1] - 1
    if picks == 0 or n_groups == 0:
        return y
    if programs is not None:
        from k3run.kernels.nvfp4_gemm import expert_stream  # (it imports this module's pieces)

        expert_stream.launch_stream(x, weight, scale_u8, global_scale, groups, y, slot_div, rows, programs,
                                    stages, pdl, early_table, act_kw)  # fmt: skip
        return y
    kw = dict(
        ids_ptr=groups,
        n_experts=n_exp,
        slot_div=slot_div,
        grp_ptr=groups,
        BYEXP=True,
        n=rows,
        EARLY=early_table,
        **act_kw,
    )
    _launch_grouped(
        x, weight, scale_u8, global_scale, y, n_groups, bt, bt, split_k, maxnreg, pdl, stages=stages, **kw
    )
    return y


def _launch_grouped(
    x: torch.Tensor, weight: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
    y: torch.Tensor, items: int, bt: int, m: int, split_k: int, maxnreg: int | None, pdl: bool,
    n: int | None = None, stages: int = 2, **extra,
) -> None:  # fmt: skip
    """The cp.async kernel over stacked tiled128 experts with grid axis 2 = `items` (picks, or groups for the
    expert-major form), split-K workspace and counters per item; n: the weight rows computed (default y's
    width); stages: the weight ring's slots; `extra`: the mode's kernel arguments."""
    from k3run.kernels.nvfp4_gemm.triton import largest_divisor

    n_pad, k_pad, k = weight.shape[1], weight.shape[2] * 2, x.shape[1]
    split_k = largest_divisor(k_pad // CHUNK, split_k)
    grid_n = n_pad // 16
    if split_k > 1:
        ws = torch.empty((items, split_k, grid_n * 16, bt), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, items * grid_n)
    else:
        ws = cnt = y
    common = (x, weight.view(torch.int32), scale_u8.view(torch.int32), global_scale, global_scale)
    n = n or y.shape[1]
    _launch_async(
        (grid_n, split_k, items), common, y, ws, cnt, m, n, k, k_pad, split_k, 1, bt, stages, True, True,
        pdl, maxnreg, global_scale.shape[1] != 1, False, w_estride=n_pad * k_pad // 8,
        s_estride=n_pad * k_pad // 64, gs_estride=global_scale.shape[1], GROUPED=True, **extra,
    )  # fmt: skip


def _launch_async(
    grid: tuple[int, ...], common: tuple, y: torch.Tensor, ws: torch.Tensor, cnt: torch.Tensor, m: int,
    n: int, k: int, k_pad: int, split_k: int, num_warps: int, bt: int, stages: int, tiled: bool, sm89: bool,
    pdl: bool, maxnreg: int | None, per_col: bool, has_bias: bool, token_warps: int = 1, **extra,
) -> None:  # fmt: skip
    """Launch the cp.async kernel: the decoder (tiled128 shifts or split128 byte permutes) and its scale
    conversion for x's dtype, the layouts of the program shape (num_warps row warps x token_warps token
    warps); `extra`: the grouped arguments."""
    x = common[0]
    bf16 = x.dtype == torch.bfloat16
    if tiled:
        asm = _TILED_ASM_BF16 if bf16 else _TILED_ASM_FP16
        scale_asm, out_scale = (_SCALE_WORD_ASM_BF16 if bf16 else _SCALE_WORD_ASM_FP16), SHIFT_OUT_SCALE
    else:
        asm, out_scale = _ASM_BF16 if bf16 else _ASM_FP16, 1.0
        scale_asm = (_SCALE_ASM_BF16 if bf16 else _SCALE_ASM) if sm89 else ""
    mma, la, lw4, lb, lcw, lcs, smem = async_layouts(num_warps, bt, token_warps)
    bn = 16 * num_warps
    _nvfp4_gemv_async_kernel[grid](
        *common, y, ws, cnt, decode_tables(x.device, "bf16" if bf16 else "fp16"), m, n, x.stride(0),
        y.stride(0),
        K=k, K_PAD=k_pad, SPLIT_K=split_k, PER_COL_GS=per_col, HAS_BIAS=has_bias, EVEN_N=n % bn == 0, BN=bn,
        BT=bt, STAGES=stages, ASM=asm, SCALE_ASM=scale_asm, MMA=mma, LA=la, LW4=lw4, LB=lb, LCW=lcw, LCS=lcs,
        SMEM=smem, TILED=tiled, OUT_SCALE=out_scale, PDL=pdl,
        LSW=scale_word_layout(num_warps, bt, token_warps), num_warps=num_warps * token_warps,
        maxnreg=maxnreg or MAXNREG[bt // token_warps], launch_pdl=pdl, **extra,
    )  # fmt: skip
