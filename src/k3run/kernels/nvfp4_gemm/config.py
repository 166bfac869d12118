"""Which NVFP4 kernel and launch a call of M rows takes (`choose_config`), and the thresholds behind it, each
from the H200 measurements in bench/RESULTS.md."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from k3run.knobs import knobs

from .layout import CHUNK


@dataclass(frozen=True)
class GemmConfig:
    """One launch of `nvfp4_gemm` (dequant_mm=True: dequantize the weight, then cuBLAS).

    decode=1 is the PTX decoder (bf16/fp16 on CUDA); fp32 inputs always use the portable decoder 0.
    split_k > 1 splits K over that many programs per output tile (fp32 partials + one epilogue kernel).
    gemv=True runs the Gluon decode kernel (gluon_gemv.py; M <= 32 a launch, bf16/fp16): 16 * num_warps rows
    per program, 128-wide K tiles staged through smem_stages (>= 2) shared-memory slots by cp.async,
    split_k programs per row block (reduced in the same launch); block_k, block_m and num_stages are the
    Triton kernel's and do not apply.
    maxnreg: the Gluon kernel's register cap (None: its default per token tile).
    token_warps: the Gluon kernel's warps a program that split the 32-token tile's columns (nvfp4_gemv;
    nvfp4_linear's launches of <= 16 rows take 1).
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
    dequant_mm: bool = False
    gemv: bool = False
    smem_stages: int = 2
    maxnreg: int | None = None
    token_warps: int = 1
    tile: bool = False
    wgmma: bool = False


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
# at 1024 (the Gluon kernel stops at 256 rows; on the matrices w4a16_sm90 takes, nvfp4_linear runs the CUDA
# C++ GEMM up to w4a16_sm90.MAX_M rows, elsewhere dequantize + cuBLAS)
WGMMA_MIN_M = 17
WGMMA_MAX_M = 256
# ...but at 17..32 rows only on matrices of at least this many weights (the CUDA C++ GEMM's bound,
# w4a16_sm90.MIN_WEIGHTS); smaller ones stay on the decode kernel. H200, bench_wgmma at Kimi Linear's shapes
# (bench/RESULTS.md), the decode kernel against the wgmma GEMM (x reordered / gathered) at 17 and 32
# rows: 12448x2304 14.3 / 16.1 us against 23.3 / 16.6 (20.0 / 20.2), 2304x4096 8.9 / 9.4 against 15.4 / 15.4
# (12.3 / 12.5), 2048x2304 7.1 / 7.5 against 12.3 / 12.2 (9.2 / 9.4); at 64 rows the wgmma GEMM is faster
# (19.4 / 20.9 / 14.5 against the decode kernel's two launches or the tile GEMM: 34.1 / 37.7 / 22.6)
WGMMA_SMALL_M_MIN_WEIGHTS = 32 << 20


def programs_per_sm(regs: int, warps: int = 1) -> int:
    """How many programs of `warps` warps and `regs` registers per thread an sm_90 SM holds at once: at most
    32 blocks, and each of the 4 schedulers' 16384-register files holds whole warps (registers allocated 8
    per thread at a time). Measured on an H200 (bench/RESULTS.md): 32 one-warp programs at 64 registers, 24
    at 80, 20 uncapped at the 16-token tile's ~90."""
    return min(32, 4 * (16384 // (-(-regs // 8) * 8 * 32)) // warps)


# ptxas' registers for the decode kernel's 16-token tile (sm_90, Triton 3.6): 86-90 uncapped (the H200 held
# 20 such programs per SM), 80 with no spills when capped at 80 (72 spills); the 8-token tile takes 62-64
GEMV_REGS_T16 = 90
GEMV_REGS_T16_CAPPED = 80
# and the 32-token tile: 141 uncapped (sm_90, Triton 3.6, no spills; compiled for sm_90 on a CPU), 12 per SM.
# Under a 128-register cap it fits 16 per SM but ran 3-6% slower a launch on an H100 (bench/RESULTS.md), so it
# runs uncapped.
GEMV_REGS_T32 = 141
# The 32-token tile's program forms (K3RUN_GEMV_T32_FORM): (row warps, token warps) -> ptxas' registers a
# thread (sm_90, Triton 3.9 on a CPU, K = 2304, no spills). Row warps take 16 weight rows each; token warps
# split the 32 token columns, each decoding the same rows from the program's shared ring.
GEMV_T32_FORMS = {
    (1, 1): GEMV_REGS_T32, (1, 2): 88, (1, 4): 62, (2, 1): 143, (2, 2): 90, (2, 4): 64, (4, 1): 143,
    (4, 2): 90,
}  # fmt: skip
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
    if m > 16:  # the 32-token tile: no register cap (capped at 128 it ran slower on an H100)
        return split(programs_per_sm(GEMV_REGS_T32)), None
    free, capped = split(programs_per_sm(GEMV_REGS_T16)), split(programs_per_sm(GEMV_REGS_T16_CAPPED))
    return (capped, GEMV_REGS_T16_CAPPED) if capped > free else (free, None)


def tile32_split(n: int, k: int, sms: int = DEFAULT_SMS, form: tuple[int, int] = (1, 1)) -> int:
    """split_k of the decode kernel's 32-token tile (17..32 rows) on an N x K weight, for programs of `form`
    (GEMV_T32_FORMS).

    K up to 4096 (32 chunks of 128; Kimi Linear's dense shapes): the largest divisor of the chunk count, at
    most 8, whose programs fit on the GPU at once (`programs_per_sm` at the form's registers and warps; 12
    one-warp programs) and leave each program at least 3 chunks. On an H100 (bench/RESULTS.md, 32 rows, the
    1-warp 2-slot launch) that is the fastest split, or within 1% of it, on all eight Kimi Linear shapes:
    128 x 2304 3.62 us at split 6 against 5.07 at split 4 (4.5 chunks a program), 576 x 2304 4.72 against
    5.56, 2304 x 1024 5.23 at split 2 against 5.80 at 4, 6144 x 2304 10.87 at 3 against 11.19 at 2. At 17
    rows one shape loses: 2304 x 4096 9.21 at split 8 against 8.90 at 4.
    Larger K (K3's matrices): 2 above 4096 rows, else 4, the best or within 3% of the best of 2 / 4 / 8 on
    the K3 shapes (the rule above was not measured there)."""
    rows, tokens = form
    fit = programs_per_sm(GEMV_T32_FORMS[form], rows * tokens)
    return _tile32_split(n, k, sms, fit, rows)


def t32_form() -> tuple[int, int]:
    """K3RUN_GEMV_T32_FORM as (row warps, token warps)."""
    rows, tokens = knobs().gemv_t32_form.split("/")
    return int(rows), int(tokens)


@functools.cache  # on every eager nvfp4_linear call of 17..64 rows (choose_config)
def _tile32_split(n: int, k: int, sms: int, fit_per_sm: int, row_warps: int = 1) -> int:
    """tile32_split for `fit_per_sm` programs an SM of 16 * row_warps rows each."""
    from .triton import largest_divisor

    chunks, blocks = -(-k // CHUNK), -(-n // (16 * row_warps))
    if chunks > 32:
        return 2 if n > 4096 else 4
    fit = sms * fit_per_sm // blocks
    return largest_divisor(chunks, max(1, min(8, fit, chunks // 3)))


def choose_config(m: int, n: int, k: int, sms: int = DEFAULT_SMS, wgmma: bool = False) -> GemmConfig:
    """The launch for M rows on a GPU of `sms` SMs, from the H200 measurements in bench/RESULTS.md.

    M <= 32: the Gluon decode kernel's cp.async variant: 1-warp programs (16 rows), 128-wide K tiles staged
    through 2 shared-memory slots, split_k programs per row block.
    - M <= 16: `one_wave_split` (H200, bench/RESULTS.md: against a fixed split_k rule 8-20% faster on
      12288x7168 at M = 1..16, 2-8% on 7168x12288 at M = 4..16, equal elsewhere within noise).
    - M = 17..32: programs of K3RUN_GEMV_T32_FORM, split by `tile32_split`.
    - M = 33..64 on matrices of at least GEMV_PAIR_MIN_WEIGHTS weights: the same kernel in two launches.
    Larger M, and 33..64 on smaller matrices: the tensor-core tile GEMM up to TILE_MAX_M rows, dequantize
    to bf16 + cuBLAS above (the split128 Triton kernel stays available through an explicit GemmConfig).
    wgmma (the device runs wgmma.py: sm_90): the wgmma GEMM for WGMMA_MIN_M <= M <= WGMMA_MAX_M instead,
    except at M <= 32 on matrices under WGMMA_SMALL_M_MIN_WEIGHTS weights.
    """
    if wgmma and WGMMA_MIN_M <= m <= WGMMA_MAX_M and (m > GEMV_AUTO_M or n * k >= WGMMA_SMALL_M_MIN_WEIGHTS):
        return GemmConfig(wgmma=True)
    if m <= GEMV_AUTO_M or (m <= GEMV_MAX_M and n * k >= GEMV_PAIR_MIN_WEIGHTS):
        if m <= 16:
            split_k, maxnreg = one_wave_split(m, n, k, sms)
            return GemmConfig(gemv=True, num_warps=1, split_k=split_k, smem_stages=2, maxnreg=maxnreg)
        form = t32_form()
        rows, tokens = form
        split_k = tile32_split(n, k, sms, form)
        return GemmConfig(gemv=True, num_warps=rows, split_k=split_k, smem_stages=2, token_warps=tokens)
    if m <= TILE_MAX_M:  # (up to 32 rows, and 33..64 on large matrices, the decode kernel runs instead)
        return GemmConfig(tile=True)
    return GemmConfig(dequant_mm=True)


@functools.cache
def sm_count(index: int) -> int:
    """The SM count of CUDA device `index` (a fixed property of the hardware)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
