"""NVFP4 W4A16 tile GEMM on tensor cores for many rows per weight: prefill linears and grouped MoE experts.

y[rows, N] = (x[rows, K] @ (e2m1(W) * s)[N, K]^T) * global_scale, fp32 accumulation, one rounding to x's
dtype at the end. The weight is read in the tiled128 layout (package __init__: `tile_split128`), the layout
the decode kernels read, so one copy of each weight serves decode and prefill.

One program computes a BM x BN output tile. Per 128-wide K chunk it loads the chunk's 32-bit words of BN
rows ([BN, 16] words: 16 rows x 64 bytes per 1 KB block) and one E4M3 scale pair per word, decodes them in
registers straight to the 16-bit MMA operand (no dequantized weight in memory) and runs two K = 64 dots
against the chunk's two halves of x (the tiled word holds k = 4w..4w+3 in its low nibbles and k = 64 + 4w..
in its high ones). Decoders (same values):
- ASM (bf16/fp16 on sm_89+): the shift decoder of the decode kernel (gluon_gemv.tiled_word_decode_asm):
  weights come out as e2m1 * s * 2^-7 exactly, and the epilogue multiplies by 2^7 (SHIFT_OUT_SCALE).
- portable (the interpreter, fp32 inputs): the nibbles rebuilt bit by bit, decoded in fp32.
e2m1 * s has at most 6 significant bits, so each decoded weight is exact in bf16 and fp16: the roundings are
the fp32 tensor-core sums and the output cast, as in the decode kernels.

Grouped form (`nvfp4_tile_gemm_grouped`, the routed experts of prefill and large decode batches): the rows
come from `expert_blocks`' table: each table row names an expert and up to BM pick indices; the program
gathers x rows pick // x_div, reads that expert's weight and scales, and writes output rows = pick indices.
The table is built on the device without a host read-back, so the call can sit in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3run.kernels.fp8_gemm.triton import grouped_tile
from k3run.kernels.nvfp4_gemm.triton import (  # the tiled128 word's bit positions (TILED_PAIR_BITS)
    _PAIR_M0,
    _PAIR_M1,
    _PAIR_M2,
    _PAIR_M3,
    _PAIR_S0,
    _PAIR_S1,
    _PAIR_S2,
    _PAIR_S3,
    _nibble,
)

SHIFT_OUT_SCALE = 128.0  # the ASM decoder's weights are e2m1 * s * 2^-7 (gluon_gemv.SHIFT_OUT_SCALE)


@functools.cache
def word_asm(kind: str) -> str:
    """PTX: one tiled128 word ($4) and its E4M3 scale pair ($5: the low nibbles' scale byte, then the high
    nibbles', in the low 16 bits) -> the word's 4 output pairs $0..$3 as packed 16-bit floats (kind "bf16"
    or "fp16"), each e2m1 * s * 2^-7. The scale pair is converted as the decode kernel's scale asm does
    (cvt.f16x2.e4m3x2; bf16: the f16 bits >> 3 plus the exponent offset)."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import (
        BF16_SCALE_EXP_ADD,
        FP16_SCALE_EXP_ADD,
        tiled_word_decode_asm,
    )

    fix = (
        f"shr.b32 sc, sc, 3;\nadd.u32 sc, sc, 0x{BF16_SCALE_EXP_ADD:08X};"
        if kind == "bf16"
        else f"add.u32 sc, sc, 0x{FP16_SCALE_EXP_ADD:08X};"
    )
    body = tiled_word_decode_asm(kind).strip()
    assert body.startswith("{") and body.endswith("}")
    head = "{\n.reg .b32 sc;\n.reg .b16 slo, shi;\nmov.b32 {slo, shi}, $5;\ncvt.rn.f16x2.e4m3x2 sc, slo;\n"
    return head + fix + body[1:].replace("$5", "sc") + "\n"


@triton.jit
def _e2m1(nib):
    """fp32 value of E2M1 codes (int32 nibbles)."""
    c = nib & 7
    e = c >> 1
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def _portable_pair(q, xs, ys, scale):
    """Both elements of one output pair of words q (int32): (element 0, element 1) in fp32 times scale."""
    return _e2m1(_nibble(q, xs, ys)) * scale, _e2m1(_nibble(q, xs + 16, ys + 16)) * scale


@triton.jit
def _tanh(z):
    """fp32 tanh within a few ulps: an odd series below |z| = 1/8 (next term ~2e-10 relative), else
    (1 - e) / (1 + e) with e = exp(-2|z|) (the subtraction loses at most ~4 ulps there)."""
    a = tl.abs(z)
    z2 = z * z
    small = z * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0))))
    ex = tl.exp(-2.0 * a)
    big = (1.0 - ex) / (1.0 + ex)
    return tl.where(a < 0.125, small, tl.where(z < 0, -big, big))


@triton.jit
def _halves(o, DT: tl.constexpr):
    """uint32 packed pairs -> (low, high) 16-bit floats of type DT."""
    lo = (o & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
    hi = (o >> 16).to(tl.uint16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def _decode_chunk(q, sp, BN: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """Words q (int32 [BN, 16]) and scale pairs sp (int32 [BN, 16], low byte: the low nibbles' E4M3 scale,
    next byte: the high nibbles') of one 128-wide chunk -> (w_lo, w_hi) [BN, 64] in DT: k 0..63, 64..127."""
    if ASM != "":
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            asm=ASM,
            constraints="=r,=r,=r,=r,r,r",
            args=[q, sp],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
        a0, a1 = _halves(o0, DT)
        b0, b1 = _halves(o1, DT)
        c0, c1 = _halves(o2, DT)
        d0, d1 = _halves(o3, DT)
    else:
        s_lo = (sp & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s_hi = ((sp >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        a0, a1 = _portable_pair(q, _PAIR_S0, _PAIR_M0, s_lo)
        b0, b1 = _portable_pair(q, _PAIR_S1, _PAIR_M1, s_lo)
        c0, c1 = _portable_pair(q, _PAIR_S2, _PAIR_M2, s_hi)
        d0, d1 = _portable_pair(q, _PAIR_S3, _PAIR_M3, s_hi)
        a0, a1, b0, b1 = a0.to(DT), a1.to(DT), b0.to(DT), b1.to(DT)
        c0, c1, d0, d1 = c0.to(DT), c1.to(DT), d0.to(DT), d1.to(DT)
    # word w's pairs: (a0, a1) = k 4w, 4w+1; (b0, b1) = 4w+2, 4w+3; c, d: the same at 64 + 4w. Two joins put
    # them in k order: [.., p, e] -> k = 4w + 2p + e
    w_lo = tl.reshape(tl.join(tl.join(a0, b0), tl.join(a1, b1)), (BN, 64))
    w_hi = tl.reshape(tl.join(tl.join(c0, d0), tl.join(c1, d1)), (BN, 64))
    return w_lo, w_hi


@triton.jit
def _tile_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, grp_ptr,
    M, N, N_PAD, stride_xm, stride_ym, x_div, w_estride, s_estride, gs_estride,
    K: tl.constexpr, K_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
    GROUPED: tl.constexpr, PER_COL_GS: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
    OUT_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, GATED: tl.constexpr = 0, BETA: tl.constexpr = 0.0,
    LINEAR_BETA: tl.constexpr = 0.0,
):  # fmt: skip
    """GATED 1 (SiLU) / 2 (SiTU): the weight holds gate rows [0, N) and up rows [N, 2N) (N a multiple of 16);
    the program computes both for its BN output columns and stores act(gate, up) (module docstring)."""
    CH: tl.constexpr = K_PAD // 128
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_r = tl.arange(0, BM)
    if GROUPED:  # table row pid_m: [expert, BM pick indices (-1 = none)]
        e = tl.load(grp_ptr + pid_m * (BM + 1))
        if e < 0:
            return
        picks = tl.load(grp_ptr + pid_m * (BM + 1) + 1 + offs_r)
        mask_m = picks >= 0
        picks = tl.maximum(picks, 0)
        x_rows = picks // x_div
        y_rows = picks
    else:
        e = 0
        y_rows = pid_m * BM + offs_r
        mask_m = y_rows < M
        x_rows = tl.where(mask_m, y_rows, 0)
    e64 = e.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_nl = offs_n < N_PAD  # rows the tiled weight holds (zero rows past N)
    offs_w = tl.arange(0, 16)
    rb = (offs_n // 16).to(tl.int64)
    r16 = offs_n % 16
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + e64 * w_estride
    w_ptrs = w32 + (rb * CH * 256 + r16 * 16)[:, None] + offs_w[None, :]
    # word w's scale pair: group g = w // 4 at byte 4 (g % 2) + 2 (g // 2) of the row's 8 (TILED_SCALE_ORDER)
    g = offs_w // 4
    s16 = s_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + e64 * s_estride
    s_ptrs = s16 + (rb * CH * 64 + r16 * 4)[:, None] + ((g % 2) * 2 + g // 2)[None, :]
    offs_k = tl.arange(0, 64)
    x_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # y^T = W x^T: the decoded weight tile is the register (A) operand of the MMA (wgmma on sm_90, whose M is
    # the weight rows: BN a multiple of 64 there), x^T the shared-memory (B) operand, so BM can be as small
    # as an expert's share of a prefill's picks
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)  # GATED: the up rows' sums (unused otherwise)
    up_w = (N // 16) * CH * 256  # GATED: from a gate row's words / scale pairs to its up row's
    up_s = (N // 16) * CH * 64
    for c in range(CH):
        if K == K_PAD:
            x_lo = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            x_hi = tl.load(x_ptrs + 64, mask=mask_m[:, None], other=0.0)
        else:
            k0 = c * 128
            x_lo = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            x_hi = tl.load(x_ptrs + 64, mask=mask_m[:, None] & (offs_k[None, :] + 64 < K - k0), other=0.0)
        x_lo_t = tl.trans(x_lo)
        x_hi_t = tl.trans(x_hi)
        q = tl.load(w_ptrs, mask=mask_nl[:, None], other=0)
        sp = tl.load(s_ptrs, mask=mask_nl[:, None], other=0).to(tl.int32)
        w_lo, w_hi = _decode_chunk(q, sp, BN, x_ptr.dtype.element_ty, ASM)
        acc = tl.dot(w_lo, x_lo_t, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(w_hi, x_hi_t, acc, input_precision=DOT_PRECISION)
        if GATED:
            q = tl.load(w_ptrs + up_w, mask=mask_nl[:, None], other=0)
            sp = tl.load(s_ptrs + up_s, mask=mask_nl[:, None], other=0).to(tl.int32)
            w_lo, w_hi = _decode_chunk(q, sp, BN, x_ptr.dtype.element_ty, ASM)
            acc_u = tl.dot(w_lo, x_lo_t, acc_u, input_precision=DOT_PRECISION)
            acc_u = tl.dot(w_hi, x_hi_t, acc_u, input_precision=DOT_PRECISION)
        w_ptrs += 256
        s_ptrs += 64
        x_ptrs += 128
    mask_n = offs_n < N
    gsp = gs_ptr + e64 * gs_estride
    if PER_COL_GS:
        acc = acc * (tl.load(gsp + offs_n, mask=mask_n, other=0.0) * OUT_SCALE)[:, None]
    else:
        acc = acc * (tl.load(gsp) * OUT_SCALE)
    if GATED:
        # gate and up rounded to the output dtype first, as the unfused path stores them; the activation in
        # fp32, one rounding at the end (layers/activation.py)
        dt = y_ptr.dtype.element_ty
        gate = acc.to(dt).to(tl.float32)
        up = (acc_u * (tl.load(gsp + N + offs_n, mask=mask_n, other=0.0) * OUT_SCALE)[:, None]).to(dt)
        up = up.to(tl.float32)
        if GATED == 1:
            acc = gate * tl.sigmoid(gate) * up
        else:
            acc = BETA * _tanh(gate / BETA) * tl.sigmoid(gate)
            if LINEAR_BETA > 0:
                up = LINEAR_BETA * _tanh(up / LINEAR_BETA)
            acc = acc * up
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + y_rows.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def _asm_for(x: torch.Tensor) -> str:
    """The ASM decoder where it runs (bf16/fp16 on a CUDA device of sm_89+), else "" (portable)."""
    if not x.is_cuda or x.dtype == torch.float32 or torch.cuda.get_device_capability(x.device) < (8, 9):
        return ""
    return word_asm("bf16" if x.dtype == torch.bfloat16 else "fp16")


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(
            f"nvfp4 tile gemm input: expected [rows, {k}] with unit stride along K, got {tuple(x.shape)}"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nvfp4 tile gemm input: expected bf16/fp16/fp32, got {x.dtype}")


@functools.cache
def tile_config(rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BM rows of x, BN weight rows, num_warps, num_stages) for a dense call of `rows` rows: the fastest of 8
    launches on the H200 (bench/bench_tile.py) on 7168x7168 and 12288x7168. Up to 64 rows (64, 64, 4, 4)
    (62 / 90 us at 64); up to 128, (128, 64, 4, 4) on N <= 8192 (78 us) and (128, 128, 8, 3) above
    (115 us); beyond (128, 128, 4, 3), the best at 256-4096 rows."""
    if rows <= 64:
        return 64, 64, 4, 4
    if rows <= 128:
        return (128, 64, 4, 4) if n <= 8192 else (128, 128, 8, 3)
    return 128, 128, 4, 3


def nvfp4_tile_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, k] @ W^T * global_scale (+ bias) in x's dtype; W in the tiled128 layout (uint8
    [N_pad, K_pad/2], scales [N_pad, K_pad/16], N_pad = n rounded up to 16), global_scale fp32 [1] or
    [N_pad]."""
    _check_x(x, k)
    n_pad, k_pad = weight.shape[0], weight.shape[1] * 2
    _check_tiled(weight, scale_u8, global_scale, k, n, n_pad, k_pad, "nvfp4 tile gemm")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, warps, stages = config or tile_config(m, n, k)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    asm = _asm_for(x)
    _tile_gemm_kernel[grid](
        x, weight, scale_u8, global_scale, bias if bias is not None else global_scale, y, global_scale,
        m, n, n_pad, x.stride(0), y.stride(0), 1, 0, 0, 0,
        K=k, K_PAD=k_pad, BM=bm, BN=bn, GROUP_M=8, GROUPED=False, PER_COL_GS=global_scale.numel() != 1,
        HAS_BIAS=bias is not None, ASM=asm, OUT_SCALE=SHIFT_OUT_SCALE if asm else 1.0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def _check_half_x(x: torch.Tensor, k: int, what: str) -> None:
    """The 16-bit GEMMs' input: bf16 / fp16 [rows, k], unit stride along K."""
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{what} input: expected bf16/fp16 [rows, {k}] with unit stride along K, got {x.dtype} "
            f"{tuple(x.shape)}"
        )


def _check_bias(bias: torch.Tensor | None, n: int, what: str, dtype: torch.dtype | None = None) -> None:
    """A bias is contiguous [n] (and of `dtype` where the kernel reads it as that type)."""
    if bias is None:
        return
    if bias.shape != (n,) or not bias.is_contiguous() or (dtype is not None and bias.dtype != dtype):
        kind = f"{dtype} " if dtype is not None else ""
        raise ValueError(f"{what}: bias must be contiguous {kind}[{n}], got {tuple(bias.shape)}")


def _check_tiled(
    weight: torch.Tensor, scale_u8: torch.Tensor, gs: torch.Tensor, k: int, n: int, n_pad: int, k_pad: int,
    what: str, experts: int | None = None,
) -> None:  # fmt: skip
    lead = () if experts is None else (experts,)
    if weight.dtype != torch.uint8 or not weight.is_contiguous() or n_pad % 16 or not n_pad - 16 < n <= n_pad:
        raise ValueError(
            f"{what}: weight must be contiguous uint8 {(*lead, 'N_pad', 'K_pad/2')} with N_pad = {n} rounded "
            f"up to 16, got {weight.dtype} {tuple(weight.shape)}"
        )
    if k_pad % 128 or not k_pad - 128 < k <= k_pad or k % 16:
        raise ValueError(f"{what}: K={k} (a multiple of 16) must round up to the tiled width {k_pad}")
    want = (*lead, n_pad, k_pad // 16)
    if scale_u8.dtype != torch.uint8 or tuple(scale_u8.shape) != want or not scale_u8.is_contiguous():
        raise ValueError(
            f"{what}: scales must be contiguous uint8 {want}, got {scale_u8.dtype} {tuple(scale_u8.shape)}"
        )
    per = gs.shape[-1] if gs.dim() else 1
    if gs.dtype != torch.float32 or not gs.is_contiguous() or per not in (1, n_pad):
        raise ValueError(
            f"{what}: global scale must be contiguous fp32 with 1 or {n_pad} per expert, "
            f"got {gs.dtype} {tuple(gs.shape)}"
        )


DEFAULT_GROUPED_CONFIG = (
    128,
    4,
    3,
)  # (BN weight rows, num_warps, num_stages) of the grouped launch; not yet tuned


@triton.jit
def _expert_count_kernel(ids_ptr, cnt_ptr, P, BLOCK: tl.constexpr):
    """Program e: the picks of expert e."""
    e = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        acc += (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
    tl.store(cnt_ptr + e, tl.sum(acc, axis=0))


@triton.jit
def _expert_place_kernel(
    ids_ptr, cnt_ptr, grp_ptr, P, E, BM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr
):  # fmt: skip
    """Program e: its first block = the exclusive scan of ceil(count / BM) over the experts before it; its
    blocks' headers; each of its picks, in increasing order, at rank r: block first + r // BM, column
    1 + r % BM. The table was filled with -1."""
    e = tl.program_id(0)
    ee = tl.arange(0, BLOCK_E)
    nb = (tl.load(cnt_ptr + ee, mask=ee < E, other=0) + (BM - 1)) // BM
    first = tl.sum(tl.where(ee < e, nb, 0), axis=0)
    mine = tl.sum(tl.where(ee == e, nb, 0), axis=0)
    for b in range(0, mine):
        tl.store(grp_ptr + (first + b).to(tl.int64) * (BM + 1), e)
    base = 0
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        hit = (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
        r = base + tl.cumsum(hit, axis=0) - 1
        slot = (first + r // BM).to(tl.int64) * (BM + 1) + 1 + r % BM
        tl.store(grp_ptr + slot, offs, mask=hit != 0)
        base += tl.sum(hit, axis=0)


def expert_blocks(ids: torch.Tensor, n_experts: int, bm: int, *, kernel: bool | None = None) -> torch.Tensor:
    """The picks ids [P] (local expert per (token, slot) pick; outside [0, n_experts): another rank's) grouped
    by expert into blocks of up to bm: the same table as `groups.expert_groups` ([max_groups(P, E, bm),
    1 + bm] int32: column 0 the expert or -1, then the block's pick indices in increasing order, -1 past its
    count), for prefill sizes (expert_groups is one program, for decode batches). No host read-back.
    On CUDA (kernel=None) three launches: the -1 fill, one program per expert counting its picks, one per
    expert placing them; elsewhere (or kernel=False) `expert_blocks_ref`'s sorts and scatters."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_blocks: ids must be int32/int64 [P], got {ids.dtype} {tuple(ids.shape)}")
    if bm < 1 or n_experts < 1:
        raise ValueError(f"expert_blocks: bm={bm}, n_experts={n_experts}; both must be >= 1")
    if not (ids.is_cuda if kernel is None else kernel):
        return expert_blocks_ref(ids, n_experts, bm)
    from .groups import max_groups

    p, e = ids.shape[0], n_experts
    grp = torch.full((max_groups(p, e, bm), bm + 1), -1, dtype=torch.int32, device=ids.device)
    if p == 0:
        return grp
    global _BLOCKS_KERNEL_OK
    from k3run.kernels.build_errors import BUILD_ERRORS, triton_build_failed

    if not _BLOCKS_KERNEL_OK:
        return expert_blocks_ref(ids, n_experts, bm)
    ids = ids.contiguous()
    cnt = torch.empty(e, dtype=torch.int32, device=ids.device)
    try:
        _expert_count_kernel[(e,)](ids, cnt, p, BLOCK=1024, num_warps=4)
        _expert_place_kernel[(e,)](
            ids, cnt, grp, p, e, BM=bm, BLOCK=1024, BLOCK_E=triton.next_power_of_2(e), num_warps=4
        )  # fmt: skip
    except BUILD_ERRORS as err:  # a Triton that cannot build them: the torch form
        if not triton_build_failed(err):
            raise
        import logging

        logging.getLogger(__name__).warning("expert_blocks: kernels failed to build, torch form: %s", err)
        _BLOCKS_KERNEL_OK = False
        return expert_blocks_ref(ids, n_experts, bm)
    return grp


_BLOCKS_KERNEL_OK = True  # False once the expert_blocks kernels failed to build


def expert_blocks_ref(ids: torch.Tensor, n_experts: int, bm: int) -> torch.Tensor:
    """`expert_blocks` from sorts and scatters (torch only)."""
    from k3run.kernels.picks import sort_picks

    from .groups import max_groups

    p, e, dev = ids.shape[0], n_experts, ids.device
    blocks = max_groups(p, e, bm)
    width = bm + 1
    grp = torch.full((blocks * width + 1,), -1, dtype=torch.int32, device=dev)  # + 1: where misses land
    if p == 0:
        return grp[:-1].view(blocks, width)
    bucket, order, counts = sort_picks(ids, e)
    sb = bucket[order]
    per = (counts + bm - 1) // bm
    last_block = torch.cumsum(per, 0)
    first_block = last_block - per
    first_pick = torch.cumsum(counts, 0) - counts
    se = sb.clamp(max=e - 1)
    rank = torch.arange(p, device=dev) - first_pick[se]
    slot = (first_block[se] + rank // bm) * width + 1 + rank % bm
    grp.scatter_(0, torch.where(sb < e, slot, blocks * width), order.to(torch.int32))
    owner = torch.searchsorted(last_block, torch.arange(blocks, device=dev), right=True)
    grp[: blocks * width].view(blocks, width)[:, 0] = torch.where(owner < e, owner, -1).to(torch.int32)
    return grp[:-1].view(blocks, width)


def _check_grouped(
    x: torch.Tensor, weight: torch.Tensor, scale_u8: torch.Tensor, global_scale: torch.Tensor,
    grp: torch.Tensor, k: int, activation: tuple[str, float, float | None] | None, what: str,
) -> tuple[int, int, int, int, float, float, int]:  # fmt: skip
    """The grouped launches' argument checks: (experts, N, K_pad, gated 0 / 1 SiLU / 2 SiTU, beta,
    linear_beta, output columns)."""
    if weight.dim() != 3:
        raise ValueError(f"{what}: weight must be [E, N, K_pad/2], got {tuple(weight.shape)}")
    ne, n, k_pad = weight.shape[0], weight.shape[1], weight.shape[2] * 2
    _check_tiled(weight, scale_u8, global_scale, k, n, n, k_pad, what, ne)
    if global_scale.dim() != 2 or global_scale.shape[0] != ne:
        raise ValueError(f"{what}: global scale must be [{ne}, 1 or {n}], got {tuple(global_scale.shape)}")
    if grp.dtype != torch.int32 or grp.dim() != 2 or not grp.is_contiguous() or grp.device != x.device:
        raise ValueError(
            f"{what}: grp must be a contiguous int32 table on {x.device}, got {grp.dtype} {tuple(grp.shape)} "
            f"on {grp.device}"
        )
    gated, beta, linear_beta, n_out = 0, 0.0, 0.0, n
    if activation is not None:
        kind, b, lb = activation
        if kind not in ("silu", "situ") or n % 32 or global_scale.shape[1] != n:
            raise ValueError(
                f"{what}: a gated activation needs 'silu' or 'situ', N a multiple of 32 and per-row global "
                f"scales [E, N]; got {kind!r}, N={n}, global scale {tuple(global_scale.shape)}"
            )
        gated, n_out = (1 if kind == "silu" else 2), n // 2
        if kind == "situ":
            beta, linear_beta = float(b), float(lb or 0.0)
    return ne, n, k_pad, gated, beta, linear_beta, n_out


def nvfp4_tile_gemm_grouped(
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
    config: tuple[int, int, int] | None = None,
    activation: tuple[str, float, float | None] | None = None,
) -> torch.Tensor:
    """Grouped experts: out [picks, N] row p = x[p // x_div] @ W[e]^T * global_scale[e] for every pick p in
    grp (expert_blocks with bm = the table width - 1), in x's dtype; rows of picks in no block are left as
    `out` had them (zeros when out is None). weight [E, N, K_pad/2] / scale_u8 [E, N, K_pad/16] tiled128 per
    expert (N a multiple of 16), global_scale fp32 [E, 1] or [E, N]. config: (BN, num_warps, num_stages).
    activation ("silu", _, _) or ("situ", beta, linear_beta or None): W holds gate rows [0, N/2) and up rows
    [N/2, N) and out [picks, N/2] gets act(gate, up), each half rounded to x's dtype before the activation
    (as `layers/activation.py` on the stored halves); global_scale must then be per row [E, N]."""
    _check_x(x, k)
    ne, n, k_pad, gated, beta, linear_beta, n_out = _check_grouped(
        x, weight, scale_u8, global_scale, grp, k, activation, "nvfp4 grouped tile gemm"
    )
    bm = grp.shape[1] - 1
    if out is None:
        out = torch.zeros((picks, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (picks, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"nvfp4 grouped tile gemm: out must be {x.dtype} [{picks}, {n_out}], "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if picks == 0 or grp.shape[0] == 0:
        return out
    bn, warps, stages = config or DEFAULT_GROUPED_CONFIG
    grid = (grp.shape[0] * triton.cdiv(n_out, bn),)
    asm = _asm_for(x)
    _tile_gemm_kernel[grid](
        x, weight, scale_u8, global_scale, global_scale, out, grp,
        grp.shape[0] * bm, n_out, n_out, x.stride(0), out.stride(0), x_div, n * k_pad // 8, n * k_pad // 32,
        global_scale.shape[1],
        K=k, K_PAD=k_pad, BM=bm, BN=bn, GROUP_M=8, GROUPED=True, PER_COL_GS=global_scale.shape[1] != 1,
        HAS_BIAS=False, ASM=asm, OUT_SCALE=SHIFT_OUT_SCALE if asm else 1.0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GATED=gated, BETA=beta,
        LINEAR_BETA=linear_beta, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
