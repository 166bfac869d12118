"""NVFP4 W4A16 linear: the layout prepared once at load time and the per-call implementation choice.

CUDA inputs (`choose_config` picks, `nvfp4_linear` runs): the Gluon decode kernel (gluon_gemv.py) up to 32
rows (33..64 in two launches on large matrices); on sm_90 the wgmma GEMM (wgmma.py, or with K3RUN_SM90_CUDA=1
the CUDA C++ kernel of w4a16_sm90.cu) for 17..256 rows; elsewhere the tensor-core tile GEMM (tile.py) up to
128 rows; dequantize + cuBLAS above. CPU inputs run cpu.py (compiled loops or the SIMD extension on large
matrices, the fp32 reference otherwise). `nvfp4_to_fp8_block` is the opt-in, lossy conversion to FP8 blocks
for fp8_gemm (`--nvfp4-as-fp8`; quant/schemes.py says where it is used).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .ref import nvfp4_linear_ref

CHUNK = 128  # split128 layout: one 128-wide K chunk per 64 bytes (low nibbles k 0..63, high nibbles 64..127)
LAYOUTS = ("checkpoint", "split128", "tiled128")


def repack_split128(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (uint8 [N, K/2], low nibble = even k; E4M3 [N, K/16]) -> kernel layout
    (uint8 [N, K_pad/2] split128 bytes, uint8 [N, K_pad/16] scale bits), K_pad = K rounded up to 128,
    zero-padded (a zero scale decodes the padding to 0)."""
    n, k = weight.shape[0], weight.shape[1] * 2
    k_pad = -(-k // CHUNK) * CHUNK
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).reshape(n, k)  # [N, K] E2M1 codes
    codes = F.pad(codes, (0, k_pad - k)).reshape(n, k_pad // CHUNK, 2, CHUNK // 2)
    packed = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k_pad // 2).contiguous()
    scale = F.pad(weight_scale.view(torch.uint8), (0, (k_pad - k) // 16)).contiguous()
    return packed, scale


# The tiled128 word: the 8 nibbles of 4 split128 bytes b0..b3 (n0..n3 = the low nibbles of b0..b3, n4..n7 the
# high ones) form 4 output pairs of the decode kernel: pair j = (n[2j], n[2j+1]) -> the low and high 16-bit
# half of one mma operand register. TILED_PAIR_BITS[j] = (sign bit, lowest magnitude bit) of n[2j] in the
# stored word; n[2j+1] sits 16 bits higher. The decoder (gluon_gemv.tiled_word_decode_asm) moves each sign
# to bit 15 and each 3-bit magnitude to bits 8..6 (bf16) or 11..9 (fp16) of its half: pair 0 is in place for
# bf16 (one AND), pair 1 needs one shift for both (sign - magnitude = 9 as in bf16), pairs 2 and 3 two shifts.
# No placement does better: 4 pairs with the bf16 spacing cannot tile the 16 bits of a half (checked by
# enumeration, bench/NOTES.md "v6").
TILED_PAIR_BITS = ((15, 6), (9, 0), (10, 3), (11, 12))
# The 8 scale bytes of a row's 128-wide chunk (groups 0..3 of the low nibbles, 4..7 of the high ones) are
# stored in the order TILED_SCALE_ORDER: the decode kernel's lane for groups {g, g + 2} (g = 0 or 1) reads one
# 32-bit word at byte 4g, (low g, high g, low g + 2, high g + 2): two cvt.f16x2.e4m3x2 operands as they are.
TILED_SCALE_ORDER = (0, 4, 2, 6, 1, 5, 3, 7)


def tiled_word(b: list[int]) -> int:
    """The stored tiled128 word of split128 bytes b[0..3] (one word of tile_split128's packing)."""
    return int(_pack_words(torch.tensor(b, dtype=torch.uint8)))


def _pack_words(b: torch.Tensor) -> torch.Tensor:
    """split128 bytes [..., 4] (uint8) -> stored tiled128 words [...] (int64 holding 32 bits)."""
    b = b.to(torch.int64)
    out = torch.zeros(b.shape[:-1], dtype=torch.int64, device=b.device)
    for j, (xs, ys) in enumerate(TILED_PAIR_BITS):
        for h in range(2):
            nib = (b[..., (2 * j + h) % 4] >> (4 * (j >= 2))) & 0xF
            out |= (nib >> 3) << (xs + 16 * h) | (nib & 7) << (ys + 16 * h)
    return out


def _unpack_words(q: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_words: words [...] (int64) -> split128 bytes [..., 4] (uint8)."""
    nib = []
    for xs, ys in TILED_PAIR_BITS:
        for h in range(2):
            nib.append(((q >> (xs + 16 * h)) & 1) << 3 | ((q >> (ys + 16 * h)) & 7))
    # n[2j + h]: bytes b_i = n_i | n_{4 + i} << 4
    return torch.stack([nib[i] | nib[4 + i] << 4 for i in range(4)], dim=-1).to(torch.uint8)


def check_scale_bytes(scale_u8: torch.Tensor, what: str = "weight_scale") -> None:
    """NVFP4 block scales are finite, non-negative E4M3 (what the format and ModelOpt write): the tiled128
    decoder builds the scale's bits by an exponent add that a sign bit or NaN would corrupt."""
    b = scale_u8.view(torch.uint8)
    bad = ((b & 0x80) != 0) & (b != 0x80) | ((b & 0x7F) == 0x7F)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"nvfp4 {what}: expected finite E4M3 scales >= 0, found {int(bad.sum())} negative or NaN "
            f"(first at {idx}: byte 0x{int(b[idx]):02x})"
        )


def tile_split128(weight: torch.Tensor, scale_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split128 bytes [N, K_pad/2] and scale bytes [N, K_pad/16] -> the tiled128 layout: rows padded with
    zeros to a multiple of 16, then [N_pad/16, K_pad/128, 16, 64] bytes and [.., 16, 8] scales (in
    TILED_SCALE_ORDER), returned as [N_pad, K_pad/2] and [N_pad, K_pad/16] tensors. A 1-warp program's K
    tiles are consecutive 1 KB blocks (split128 rows are 64-byte pieces K_pad/2 bytes apart), and each 4-byte
    word's 32 bits are placed for the shift decoder (TILED_PAIR_BITS). The codes of groups whose scale is 0
    are stored as 0 (their weights are 0 either way; the decoder's scale, built by an exponent add, is not 0
    there). Scales must be finite and >= 0 (check_scale_bytes)."""
    check_scale_bytes(scale_u8)
    n, half = weight.shape
    n_pad = -(-n // 16) * 16
    ch = half // 64
    w = torch.zeros((n_pad, half), dtype=torch.uint8, device=weight.device)
    s = torch.zeros((n_pad, half // 8), dtype=torch.uint8, device=weight.device)
    w[:n], s[:n] = weight, scale_u8
    zero = (s.view(torch.float8_e4m3fn).float() == 0).view(n_pad, ch, 2, 4, 1)  # [.., low/high, group, 1]
    keep = (~zero[:, :, 0]).to(torch.uint8) * 0x0F | (~zero[:, :, 1]).to(torch.uint8) * 0xF0
    w = (w.view(n_pad, ch, 4, 16) & keep).view(n_pad, half // 4, 4)
    words = _pack_words(w).to(torch.int32)  # the low 32 bits (int64 -> int32 wraps)
    w = words.view(torch.uint8).view(n_pad, half)  # little-endian bytes of each word
    w = w.reshape(n_pad // 16, 16, ch, 64).transpose(1, 2).contiguous().view(n_pad, half)
    s = s.view(n_pad, ch, 8)[:, :, list(TILED_SCALE_ORDER)]
    s = s.reshape(n_pad // 16, 16, ch, 8).transpose(1, 2).contiguous().view(n_pad, half // 8)
    return w, s


def untile_split128(
    weight: torch.Tensor, scale_u8: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of tile_split128: the first n rows back in split128 order."""
    n_pad, half = weight.shape
    ch = half // 64
    w = weight.view(n_pad // 16, ch, 16, 64).transpose(1, 2).reshape(n_pad, half).contiguous()
    q = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w = _unpack_words(q).reshape(n_pad, half)
    s = scale_u8.view(n_pad // 16, ch, 16, 8).transpose(1, 2).reshape(n_pad, ch, 8)
    inverse = [TILED_SCALE_ORDER.index(g) for g in range(8)]
    s = s[:, :, inverse].reshape(n_pad, half // 8)
    return w[:n].contiguous(), s[:n].contiguous()


def unpack_split128(
    packed: torch.Tensor, scale_bits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of repack_split128: back to (uint8 [N, K/2], float8_e4m3fn [N, K/16])."""
    n, k_pad = packed.shape[0], packed.shape[1] * 2
    halves = torch.stack([packed & 0xF, packed >> 4], dim=1)  # [N, 2, K_pad/2]: half, (chunk, j)
    codes = halves.reshape(n, 2, k_pad // CHUNK, CHUNK // 2).permute(0, 2, 1, 3).reshape(n, k_pad)[:, :k]
    weight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return weight, scale_bits[:, : k // 16].contiguous().view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class NvFp4Weight:
    """An NVFP4 weight in the layout its kernel reads.

    layout "checkpoint": weight uint8 [N, K/2] (low nibble = even k), scale_bits uint8 [N, K/16].
    layout "split128":   weight uint8 [N, K_pad/2], scale_bits uint8 [N, K_pad/16] (see repack_split128).
    layout "tiled128":   split128 stored tile by tile (tile_split128): [N_pad, K_pad/2] / [N_pad, K_pad/16]
                         with N_pad = N rounded up to 16 (zero rows); `rows` holds N; a per-row global_scale
                         is padded to N_pad with ones. Read by the cp.async decode kernel (up to 32 rows a
                         launch), the tile and wgmma GEMMs and the dequantize kernel.
    scale_bits are the E4M3 group scales as raw bytes (Triton loads fp8 through uint8).
    global_scale: fp32 [1] (per tensor) or [N] (fused shards with their own global scales), decode scale.
    """

    weight: torch.Tensor
    scale_bits: torch.Tensor
    global_scale: torch.Tensor
    k: int
    layout: str
    rows: int = -1  # the real N when the layout pads rows (tiled128)
    cpu_int8: Any = None  # checkpoint layout on the CPU: a cpu_simd.Vnni16Weight copy (K3RUN_CPU_INT8=1)

    @property
    def n(self) -> int:
        return self.rows if self.rows >= 0 else self.weight.shape[0]

    @property
    def row_global_scale(self) -> torch.Tensor:
        """global_scale without the layout's row padding: [1] or [N]."""
        gs = self.global_scale
        return gs if gs.numel() == 1 else gs[: self.n]

    def checkpoint_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [N, K/2], float8_e4m3fn [N, K/16]) in the checkpoint layout."""
        if self.layout == "tiled128":
            return unpack_split128(*untile_split128(self.weight, self.scale_bits, self.n), self.k)
        if self.layout == "split128":
            return unpack_split128(self.weight, self.scale_bits, self.k)
        return self.weight, self.scale_bits.view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class GemmConfig:
    """One launch of `nvfp4_gemm` (dequant_mm=True: dequantize the weight, then cuBLAS).

    decode=1 is the PTX decoder (bf16/fp16 on CUDA); fp32 inputs always use the portable decoder 0.
    split_k > 1 splits K over that many programs per output tile (fp32 partials + one epilogue kernel).
    swap_ab computes y^T = W x^T (decoded weights as the register operand; wgmma on sm90 when
    block_n >= 64); correct in the interpreter and compiled for sm_90, not yet timed on a GPU.
    gemv=True runs the Gluon decode kernel (gluon_gemv.py; M <= 32 a launch, bf16/fp16): 16 * num_warps rows
    per program, K tiles of block_k, split_k programs per row block (reduced in the same launch), `depth`
    K tiles of loads in flight per warp; smem_stages >= 2 stages the weights through shared memory by
    cp.async instead (block_k 128, smem_stages - 1 tiles in flight, no registers held for them).
    maxnreg: the Gluon kernel's register cap (None: its default per token tile).
    tile=True runs the tensor-core tile GEMM on a tiled128 weight (tile.py; bf16/fp16 on CUDA).
    wgmma=True runs the Gluon wgmma GEMM on a tiled128 weight (wgmma.py; bf16/fp16 on sm_90).
    """

    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    decode: int = 1
    split_k: int = 1
    swap_ab: bool = False
    dequant_mm: bool = False
    gemv: bool = False
    depth: int = 2
    smem_stages: int = 0
    maxnreg: int | None = None
    tile: bool = False
    wgmma: bool = False


def prepare_nvfp4_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    layout: str | None = None,
) -> NvFp4Weight:
    """Check the checkpoint tensors once and return the kernel layout.

    weight_scale_2 may be 0-dim/one element (per tensor) or [N] (one decode scale per output row).
    layout None: "tiled128" for CUDA tensors on sm_89+ with the Gluon decode kernel available, "split128" on
    other CUDA devices (the Triton kernels), "checkpoint" otherwise (the reference).
    """
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"nvfp4 weight: expected uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if k % 16:
        raise ValueError(f"nvfp4 weight: K={k} must be a multiple of 16")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // 16):
        raise ValueError(
            f"nvfp4 weight_scale: expected float8_e4m3fn {(n, k // 16)}, "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() not in (1, n):
        raise ValueError(
            f"nvfp4 weight_scale_2: expected fp32 with 1 or {n} elements, "
            f"got {weight_scale_2.dtype} {tuple(weight_scale_2.shape)}"
        )
    layout = layout or (default_cuda_layout(weight.device) if weight.is_cuda else "checkpoint")
    if layout not in LAYOUTS:
        raise ValueError(f"nvfp4 layout: expected one of {LAYOUTS}, got {layout!r}")
    gs = weight_scale_2.reshape(-1).contiguous()
    rows = -1
    if layout in ("split128", "tiled128"):
        w, s = repack_split128(weight, weight_scale)
        if layout == "tiled128":
            w, s = tile_split128(w, s)
            rows = n
            if gs.numel() > 1 and w.shape[0] > n:
                gs = torch.cat([gs, gs.new_ones(w.shape[0] - n)])
    else:
        w, s = weight.contiguous(), weight_scale.contiguous().view(torch.uint8)
    cpu_int8 = None
    if layout == "checkpoint" and not weight.is_cuda:
        from k3run.kernels import cpu_simd

        if cpu_simd.int8_activations_enabled() and cpu_simd.vnni_available():
            cpu_int8 = cpu_simd.nvfp4_vnni_pack(weight, weight_scale, gs)
    return NvFp4Weight(w, s, gs, k, layout, rows, cpu_int8)


def default_cuda_layout(device: torch.device) -> str:
    """tiled128 where its decode kernel runs (Gluon, sm_89+: the decoder converts E4M3 scales with
    cvt.f16x2.e4m3x2), split128 elsewhere (the Triton kernels)."""
    if gemv_available() and torch.cuda.get_device_capability(device) >= (8, 9):
        return "tiled128"
    return "split128"


def nvfp4_to_fp8_block(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load-time conversion for the optional FP8 tensor-core path (`--nvfp4-as-fp8`; opt-in, lossy).

    Dequantizes the NVFP4 weight exactly in fp32 and re-quantizes it to 128x128-block E4M3, returning
    (fp8 [N_pad, K] with zero pad rows, fp32 scale [N_pad/128, K/128]) ready for fp8_gemm.fp8_pb_wo_linear.
    E4M3 keeps 4 significant bits where e2m1 * e4m3 needs up to 6, so this adds a rounding error (measured
    in bench/bench_linear.py); K must be a multiple of 128.
    """
    from k3run.formats import dequantize_nvfp4, quantize_fp8_block

    w = dequantize_nvfp4(weight, weight_scale, 1.0) * weight_scale_2.float().reshape(-1, 1)
    n, k = w.shape
    if k % 128:
        raise ValueError(f"nvfp4_to_fp8_block: K={k} must be a multiple of 128 for FP8 block GEMMs")
    q, scale = quantize_fp8_block(w)
    n_pad = scale.shape[0] * 128
    q_pad = torch.zeros((n_pad, k), dtype=torch.float8_e4m3fn, device=w.device)
    q_pad[:n] = q
    return q_pad, scale.reshape(scale.shape[0], scale.shape[2]).contiguous()


_GEMV_OK: bool | None = None


def gemv_available() -> bool:
    """Whether the Gluon decode kernel can be used here (Triton with Gluon, a CUDA GPU of sm_80 or later)."""
    global _GEMV_OK
    if _GEMV_OK is None:
        try:
            from . import gluon_gemv  # noqa: F401

            _GEMV_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
        except Exception as e:  # an old Triton without Gluon, or its API changed
            import logging

            logging.getLogger(__name__).warning("nvfp4: Gluon decode kernel unavailable (%s)", e)
            _GEMV_OK = False
    return _GEMV_OK


# the split128 Triton tile kernel's decode launch, used where the Gluon kernel cannot run (block_n 64 beat
# 32 and 16 on an H200: fewer instructions per weight, bench/NOTES.md)
TRITON_DECODE = GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4)
# rows the Gluon kernel may take (in launches of <= 32), and up to where choose_config picks it (H200,
# bench/RESULTS.md: 2.0-2.8x faster than dequantize + cuBLAS at M = 24 / 32); 33..64 rows (two launches) only
# on matrices of at least GEMV_PAIR_MIN_WEIGHTS weights (at M = 64: 1.27x / 1.61x faster than dequantize +
# cuBLAS on 7168^2 / 12288x7168, 0.94x on 3072x3584; the threshold sits between the measured sizes)
GEMV_MAX_M = 64
GEMV_AUTO_M = 32
GEMV_PAIR_MIN_WEIGHTS = 24 * 2**20
# rows up to which choose_config takes the tile GEMM over dequantize + cuBLAS (outside the decode kernel's
# range). H200, bench/bench_tile.py, time of the tile GEMM / dequantize + cuBLAS on 7168x7168 and
# 12288x7168: 0.82 / 0.72 at M = 64, 0.98 / 0.90 at 128, 1.25 / 1.55 at 256 (slower from there)
TILE_MAX_M = 128
# rows for which choose_config takes the wgmma GEMM on sm_90. H200, bench/bench_wgmma.py (bench/RESULTS.md),
# on 7168x7168 / 12288x7168 / 7168x12288: against the decode kernel 1.31 / 1.06 / 1.67x faster at 32 rows,
# 0.80 / 0.95 / 0.86x at 16; against dequantize + cuBLAS 1.43 / 1.30 / 1.48x at 256, 0.92 / 0.94 / 0.89x
# at 1024 (257..1023 unmeasured: they stay on dequantize + cuBLAS)
WGMMA_MIN_M = 17
WGMMA_MAX_M = 256


def programs_per_sm(regs: int) -> int:
    """How many 1-warp programs of `regs` registers per thread an sm_90 SM holds at once: at most 32 blocks,
    and each of the 4 schedulers' 16384-register files holds whole warps (registers allocated 8 per thread
    at a time). Measured on an H200 (bench/RESULTS.md): 32 at 64 registers, 24 at 80, 20 uncapped
    at the 16-token tile's ~90."""
    return min(32, 4 * (16384 // (-(-regs // 8) * 8 * 32)))


# ptxas' registers for the decode kernel's 16-token tile (sm_90, Triton 3.6): 86-90 uncapped (the H200 held
# 20 such programs per SM), 80 with no spills when capped at 80 (72 spills); the 8-token tile takes 62-64
GEMV_REGS_T16 = 90
GEMV_REGS_T16_CAPPED = 80
# and the 32-token tile: 141 uncapped (sm_90, Triton 3.6, no spills; compiled for sm_90 on a CPU), 12 per SM
GEMV_REGS_T32 = 141
DEFAULT_SMS = 132  # H100 SXM / H200: where no device says otherwise


@functools.cache  # on every eager nvfp4_linear call (choose_config) and twice per grouped MoE call
def one_wave_split(m: int, n: int, k: int, sms: int) -> tuple[int, int | None]:
    """(split_k, maxnreg or None) for M <= 32 (the token tile's rows): the largest split_k <= 8 dividing the
    128-wide chunk count whose programs (row blocks x split_k) all fit on the GPU at once. A second wave of
    programs starts only as the first drains (per-program timelines on an H200, bench/NOTES.md: 12288x7168 at
    M = 1 ran 6144 programs on 132 x 32 slots in two waves). For the 16-token tile, the register cap of 80 is
    taken where it lets more programs in; the 32-token tile runs uncapped. Where even split_k 1 takes more
    than one wave (the grouped expert launches: rows of every pick), the smallest split_k <= 8 whose waves are
    on average >= 90% full (else the fullest)."""
    from .triton import largest_divisor

    chunks, blocks = -(-k // CHUNK), -(-n // 16)

    def split(per_sm: int) -> int:
        slots = sms * per_sm
        if blocks > slots:  # more than one wave even unsplit (grouped launches): keep the waves >= 90% full
            fill = {d: blocks * d / slots / -(-blocks * d // slots) for d in range(1, 9) if chunks % d == 0}
            return next((d for d in fill if fill[d] >= 0.9), max(fill, key=fill.__getitem__))
        return largest_divisor(chunks, min(8, max(1, slots // blocks)))

    if m <= 8:
        return split(programs_per_sm(64)), None
    if m > 16:  # the 32-token tile: no register cap (capping it spills)
        return split(programs_per_sm(GEMV_REGS_T32)), None
    free, capped = split(programs_per_sm(GEMV_REGS_T16)), split(programs_per_sm(GEMV_REGS_T16_CAPPED))
    return (capped, GEMV_REGS_T16_CAPPED) if capped > free else (free, None)


def choose_config(m: int, n: int, k: int, sms: int = DEFAULT_SMS, wgmma: bool = False) -> GemmConfig:
    """The launch for M rows on a GPU of `sms` SMs, from the H200 measurements in bench/RESULTS.md.

    M <= 32: the Gluon decode kernel's cp.async variant: 1-warp programs (16 rows), 128-wide K tiles staged
    through 2 shared-memory slots, split_k programs per row block.
    - M <= 16: `one_wave_split` (H200, bench/RESULTS.md: against a fixed split_k rule 8-20% faster on
      12288x7168 at M = 1..16, 2-8% on 7168x12288 at M = 4..16, equal elsewhere within noise).
    - M = 17..32: 2 (N > 4096) or 4 (the best or within 3% of the best of 2/4/8 on the K3 shapes).
    - M = 33..64 on matrices of at least GEMV_PAIR_MIN_WEIGHTS weights: the same kernel in two launches.
    Larger M, and 33..64 on smaller matrices: the tensor-core tile GEMM up to TILE_MAX_M rows, dequantize
    to bf16 + cuBLAS above (the split128 Triton kernel stays available through an explicit GemmConfig).
    wgmma (the device runs wgmma.py: sm_90): the wgmma GEMM for WGMMA_MIN_M <= M <= WGMMA_MAX_M instead.
    """
    if wgmma and WGMMA_MIN_M <= m <= WGMMA_MAX_M:
        return GemmConfig(wgmma=True)
    if m <= GEMV_AUTO_M or (m <= GEMV_MAX_M and n * k >= GEMV_PAIR_MIN_WEIGHTS):
        maxnreg = None
        if m <= 16:
            split_k, maxnreg = one_wave_split(m, n, k, sms)
        else:
            split_k = 2 if n > 4096 else 4
        return GemmConfig(
            gemv=True, num_warps=1, block_k=128, split_k=split_k, depth=1, smem_stages=2, maxnreg=maxnreg
        )
    if m <= TILE_MAX_M:  # (up to 32 rows, and 33..64 on large matrices, the decode kernel runs instead)
        return GemmConfig(tile=True)
    return GemmConfig(dequant_mm=True)


@functools.cache
def sm_count(index: int) -> int:
    """The SM count of CUDA device `index` (a fixed property of the hardware)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fallback(m: int) -> GemmConfig:
    return TRITON_DECODE if m <= 16 else GemmConfig(dequant_mm=True)


def _disable_gemv(err: Exception) -> None:
    global _GEMV_OK
    import logging

    logging.getLogger(__name__).warning(
        "nvfp4: Gluon decode kernel failed to compile, Triton fallback: %s", err
    )
    _GEMV_OK = False


_WGMMA_OK = True  # False once the wgmma GEMM failed to compile


@functools.cache
def _wgmma_device(index: int) -> bool:
    """CUDA device `index` runs the wgmma GEMM: sm_90 and its Gluon module importable."""
    try:
        from .wgmma import wgmma_available
    except ImportError:
        return False
    return wgmma_available(torch.device("cuda", index))


def _wgmma_ok(device: torch.device) -> bool:
    return _WGMMA_OK and device.type == "cuda" and _wgmma_device(device.index or 0)


def _disable_wgmma(err: Exception) -> None:
    global _WGMMA_OK
    import logging

    logging.getLogger(__name__).warning("nvfp4: the wgmma GEMM failed to compile, other kernels: %s", err)
    _WGMMA_OK = False


def _gemv(x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """The Gluon decode kernel, one launch per 32 rows (its widest token tile)."""
    from .gluon_gemv import nvfp4_gemv

    parts = [
        nvfp4_gemv(
            x2[i : i + 32],
            w.weight,
            w.scale_bits,
            w.global_scale,
            bias,
            num_warps=cfg.num_warps,
            block_k=cfg.block_k,
            split_k=cfg.split_k,
            depth=cfg.depth,
            stages=cfg.smem_stages,
            tiled=w.layout == "tiled128",
            rows=w.n,
            maxnreg=cfg.maxnreg,
        )
        for i in range(0, x2.shape[0], 32)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _wgmma(x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """17..256 rows on sm_90: the CUDA C++ GEMM where enabled and built (w4a16_sm90), else the Gluon wgmma
    GEMM; None (and the Gluon kernel disabled) when Triton cannot build it."""
    from k3run.kernels.build_errors import BUILD_ERRORS, triton_build_failed

    from . import w4a16_sm90
    from .wgmma import nvfp4_wgmma_gemm

    if w4a16_sm90.enabled() and w4a16_sm90.available(x2.device):  # CUDA C++, built at first use
        return w4a16_sm90.nvfp4_sm90_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    try:
        return nvfp4_wgmma_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    except BUILD_ERRORS as e:
        if not triton_build_failed(e):
            raise
        _disable_wgmma(e)
        return None


def nvfp4_linear(
    x: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias in x's dtype (bf16/fp16 on CUDA; any float dtype on CPU)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"nvfp4 linear: input has K={x.shape[-1]}, weight has K={w.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if not x2.is_cuda:
        from .cpu import nvfp4_linear_cpu

        weight, scale = w.checkpoint_tensors()
        y = nvfp4_linear_cpu(x2, weight, scale, w.row_global_scale, bias, int8=w.cpu_int8)
        return y.reshape(*lead, w.n)
    if w.layout not in ("split128", "tiled128"):
        raise ValueError(f"nvfp4 linear: CUDA inputs need a split128 or tiled128 weight, got {w.layout!r}")
    from .triton import nvfp4_dequantize, nvfp4_gemm

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    tiled = w.layout == "tiled128"
    half = x2.dtype in (torch.bfloat16, torch.float16)
    cfg = config or choose_config(
        x2.shape[0], w.n, w.k, sm_count(x2.device.index or 0), wgmma=tiled and half and _wgmma_ok(x2.device)
    )
    if (cfg.tile or cfg.wgmma) and not (tiled and half):
        cfg = GemmConfig(dequant_mm=True)
    if tiled and not (cfg.dequant_mm or cfg.tile or cfg.wgmma or (cfg.gemv and cfg.smem_stages)):
        raise ValueError(
            "nvfp4 linear: a tiled128 weight runs the cp.async decode kernel, the tile GEMM or dequantize + "
            "cuBLAS, not "
            f"{cfg}; prepare the weight with layout='split128' for the other kernels"
        )
    if cfg.gemv and not (
        x2.shape[0] <= GEMV_MAX_M and x2.dtype in (torch.bfloat16, torch.float16) and gemv_available()
    ):
        cfg = GemmConfig(dequant_mm=True) if tiled else _fallback(x2.shape[0])
    y = None
    if cfg.wgmma:
        y = _wgmma(x2, w, bias)
        if y is None:  # the Gluon kernel failed to build: the other paths from now on
            cfg = choose_config(x2.shape[0], w.n, w.k, sm_count(x2.device.index or 0))
    if cfg.tile:
        from .tile import nvfp4_tile_gemm

        y = nvfp4_tile_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    if cfg.gemv:
        from triton.compiler.errors import CompilationError

        try:
            y = _gemv(x2, w, bias, cfg)
        except CompilationError as e:  # a Triton whose Gluon API moved: use the Triton kernels from now on
            _disable_gemv(e)
            cfg = GemmConfig(dequant_mm=True) if tiled else _fallback(x2.shape[0])
    if y is None and cfg.dequant_mm:
        wd = nvfp4_dequantize(
            w.weight, w.scale_bits, w.global_scale, w.k, x2.dtype, rows=w.n if tiled else None
        )
        y = F.linear(x2, wd, bias)
    elif y is None:
        y = nvfp4_gemm(
            x2,
            w.weight,
            w.scale_bits,
            w.global_scale,
            bias,
            block_m=cfg.block_m,
            block_n=cfg.block_n,
            block_k=cfg.block_k,
            group_m=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            decode=cfg.decode if x2.dtype != torch.float32 else 0,
            split_k=cfg.split_k,
            swap_ab=cfg.swap_ab,
        )
    return y.reshape(*lead, w.n)


__all__ = [
    "CHUNK",
    "GemmConfig",
    "NvFp4Weight",
    "choose_config",
    "one_wave_split",
    "programs_per_sm",
    "sm_count",
    "nvfp4_linear",
    "nvfp4_linear_ref",
    "nvfp4_to_fp8_block",
    "prepare_nvfp4_weight",
    "repack_split128",
    "tile_split128",
    "tiled_word",
    "check_scale_bytes",
    "untile_split128",
    "unpack_split128",
]
