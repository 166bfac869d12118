"""The CUDA C++ NVFP4 W4A16 GEMM for sm_90 (w4a16_sm90.cu): built at first use, the Gluon kernel its fallback.

`nvfp4_sm90_gemm(x, weight, scale_u8, global_scale, k, n, bias)` computes what `wgmma.nvfp4_wgmma_gemm` does
(the same tiled128 weight, the same roundings: exact decoded weights, fp32 tensor-core sums, split-K partials
added in a fixed order, one rounding to x's dtype) in two launches: `prep_x` writes x's columns in the A
registers' order into swizzled [BT, 64] tiles, then the warp-specialized kernel (the .cu file's header says
how it keeps a chunk's wgmma in flight while the next chunk decodes).

The extension is compiled once per machine by torch.utils.cpp_extension (nvcc, -gencode for sm_90a; ~1-2
minutes) and cached in torch's extension directory; `available()` is False where it cannot be built or the
device is not sm_90, and the callers keep the Gluon kernel then.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from k3run.knobs import knobs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4a16_sm90.cu")
TOKEN_TILES = (16, 32, 64, 128, 256)
WARPGROUPS = (1, 2, 3)  # consumer warpgroups a CTA: 64 weight rows each (two up to BT 128, three at BT 128
# on the fixed grid, each decoding into one A set: .cu header, one_a_set)
SMEM_LIMIT = 227 * 1024  # an sm_90 CTA's dynamic shared memory


def wgmma_wrappers() -> str:
    """The `Wgmma<BT, BF16>::mma` specializations: one asm statement per token tile and dtype (BT / 2 fp32
    accumulators, the 4 A registers, the B descriptor; scale-d 1, no B transpose)."""
    out = []
    for bt in TOKEN_TILES:
        nacc = bt // 2
        for bf16 in (True, False):
            ty = "bf16" if bf16 else "f16"
            d = ", ".join(f"%{i}" for i in range(nacc))
            a = ", ".join(f"%{nacc + i}" for i in range(4))
            outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
            out.append(
                f"template <>\nstruct Wgmma<{bt}, {'true' if bf16 else 'false'}> {{\n"
                f"  __device__ __forceinline__ static void mma(float (&d)[{nacc}], uint32_t a0, uint32_t a1, "
                "uint32_t a2, uint32_t a3, uint64_t desc) {\n"
                f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{bt}k16.f32.{ty}.{ty} {{{d}}}, {{{a}}}, '
                f'%{nacc + 4}, 1, 1, 1, 0;"\n'
                f"                 : {outs}\n"
                '                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));\n'
                "  }\n};\n"
            )
    return "\n".join(out)


def cuda_source() -> str:
    """The .cu file with its generated wgmma wrappers in place."""
    return SOURCE.read_text().replace("//@@WGMMA@@", wgmma_wrappers())


_module = None
_error: str | None = None


def _build(name: str = "k3run_w4a16_sm90", source: str | None = None):
    """The extension from `source` (default: cuda_source()) under `name` (bench probes build variants of the
    GEMM's source under their own names)."""
    from torch.utils.cpp_extension import load_inline

    from k3run.kernels.cpu_simd import _clear_stale_build_lock

    _clear_stale_build_lock(name)
    log.info("building the sm_90 NVFP4 GEMM (once per machine, ~1-2 min; cached after)")
    decls = (
        "int w4a16_smem_bytes(int64_t bt, int64_t nwg, int64_t stages);\n"
        "torch::Tensor w4a16_prep_x(torch::Tensor x, int64_t bt, int64_t chunks, bool pdl);\n"
        "void w4a16_gemm(torch::Tensor xt, torch::Tensor w, torch::Tensor s, torch::Tensor gs, "
        "c10::optional<torch::Tensor> bias, torch::Tensor y, torch::Tensor ws, torch::Tensor cnt, int64_t M, "
        "int64_t N, int64_t bt, int64_t nwg, int64_t split, int64_t stages, int64_t producer, "
        "bool gather, int64_t sk_whole, int64_t sk, bool pdl);\n"
        "void w4a16_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor gs, "
        "c10::optional<torch::Tensor> bias, torch::Tensor y, torch::Tensor ws, torch::Tensor cnt, "
        "int64_t split, bool pdl, int64_t mode, c10::optional<torch::Tensor> ids, int64_t items, int64_t bt, "
        "int64_t slot_div, int64_t rows, int64_t act, double beta, double lbeta);\n"
    )
    return load_inline(
        name=name,
        cpp_sources=decls,
        cuda_sources=cuda_source() if source is None else source,
        functions=["w4a16_smem_bytes", "w4a16_prep_x", "w4a16_gemm", "w4a16_gemv"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False,
    )


# the smallest matrix (N * K weights) nvfp4_linear runs on this kernel: K3's 7168 x 7168 and 12288 x 7168 ran
# 1.06-1.32x the Gluon wgmma kernel at 32-256 rows; in the full-depth Kimi Linear decode at 32 rows (widths
# 2304 / 4096, at most 29M weights a matrix) its 123 calls took 1081 us plus 169 us of x preparation (one
# more launch a call) against the Gluon kernel's 1093 us (bench/RESULTS.md)
MIN_WEIGHTS = 32 << 20
# the most rows nvfp4_linear runs here; 257.. rows are otherwise dequantize + cuBLAS, which this kernel beats
# 1.38-1.47x at 512 rows and 1.06-1.09x at 1024 on 7168^2 / 12288x7168 / 7168x12288, and loses to at 4096
# (0.89-0.92x; H100, bench/RESULTS.md)
MAX_M = 1024


def enabled() -> bool:
    """Whether this kernel may run nvfp4_linear's calls of 17..MAX_M rows on sm_90: unless `K3RUN_SM90_CUDA=0`
    (read once)."""
    return knobs().sm90_cuda


def takes(n: int, k: int) -> bool:
    """Whether nvfp4_linear runs an N x K weight of 17..MAX_M rows here (enabled, at least MIN_WEIGHTS
    weights) rather than on the Gluon wgmma kernel (17..256) or dequantize + cuBLAS (257..); `available`
    still decides whether it can."""
    return enabled() and n * k >= MIN_WEIGHTS


@functools.cache  # available() runs on every nvfp4_linear call of 17..MAX_M rows when enabled
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(device: torch.device | None = None) -> bool:
    """sm_90 and the extension built (building it on the first call)."""
    global _module, _error
    if _error is not None or not torch.cuda.is_available():
        return False
    if device is not None and device.type != "cuda":
        return False
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    if not _is_sm90(index):
        return False
    if _module is None:
        try:
            _module = _build()
        except Exception as e:  # no nvcc, an old toolchain: the Gluon kernel instead
            _error = f"{type(e).__name__}: {e}"
            log.warning("the sm_90 CUDA NVFP4 GEMM could not be built; the Gluon kernel: %s", _error[:2000])
            return False
    return True


def smem_bytes(bt: int, nwg: int, stages: int) -> int:
    """Dynamic shared memory of a CTA (mirrors Smem<BT, NWG>::bytes in the .cu file)."""
    per_stage = 2 * bt * 128 + nwg * 4 * (1024 + 128)
    return 1024 + stages * per_stage + 2 * stages * 8 + 16


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SM_SMEM = 228 * 1024  # an sm_90 SM's shared memory, shared by its resident CTAs
# CTAs an SM the kernel is compiled for (min_ctas in the .cu file): 3 with one consumer warpgroup up to BT 64
CTAS_PER_SM_SMALL_BT = 3
# stream-K (split_k 0 in a config): the kernel exists for one consumer warpgroup, every token tile; every CTA
# gets at least SK_MIN_PAIRS chunk pairs (its ring needs a few chunks to fill)
SK_MIN_PAIRS = 2
# the fixed grid fills less than this share of its waves' CTA slots: stream-K (up to K3RUN_SM90_STREAM_K rows)
SK_BELOW_FILL = 0.9
# from BT 64 the fixed grid keeps one CTA an SM where that fills at least this share of the SMs
SM_FILL = 0.75
# above this many rows a CTA is two consumer warpgroups over a 128-token tile (128 x 128 outputs), not one
# over a 256-token tile (64 x 256): on an H100 at 256 rows (128, 2, 1, 4) ran 45.0 / 88.2 / 76.1 us on 7168^2
# / 12288x7168 / 7168x12288 against 51.9 / 99.9 / 85.2 for (256, 1, 1, 3); at 16-64 rows two warpgroups were
# within 0.89-1.06x of one (H100, bench/RESULTS.md). At 65..128 rows (BT 128) two where one warpgroup's
# tiles outnumber the SMs: 12288x7168 at 128 rows 44.1 us against 51.5 for the best one-warpgroup config (two
# CTAs an SM); where one warpgroup's tiles fit one wave it stays (7168^2 31.0 against 40.7)
TWO_WG_ABOVE_M = 128
# the ring of a two-warpgroup CTA (~41 KB a slot): 4 slots ran as fast as 5 or faster in 7 of 8 cells at
# 128-256 rows (7168x12288 at 256 rows 75.6 against 79.4 us), 3 lost 15-20%
TWO_WG_STAGES = 4


# the producer's forms (PRODUCER_* in the .cu file, by index): one thread issuing a chunk's bulk copies (x,
# then the codes and the scales of each of the CTA's row blocks); the whole warp walking the ring with one
# elected lane issuing them; that warp moving the CTA's row blocks of codes and of scales by one tensor-map
# copy each (three copies a chunk)
PRODUCERS = ("thread", "warp", "tensor")


def _producer(name: str, sk: int, nwg: int = 1) -> str:
    """The producer form `name` resolves to: auto is tensor on the fixed grid (with one consumer warpgroup
    1.02-1.10x the one-thread form at 16-64 rows on an H100, 1.30x at 128; with two 1.2-1.6x at 192-1024)
    and wherever two consumer warpgroups run (the tail split); thread for one warpgroup's stream-K (where
    tensor and warp measured 0.89-0.95x the one-thread form at 16 rows, 1.00-1.04x at 32)."""
    if name != "auto":
        return name
    return "tensor" if sk == 0 or nwg >= 2 else "thread"


def ctas_per_sm(bt: int, nwg: int, stream_k: bool = False) -> int:
    """CTAs an SM the kernel is compiled for (min_ctas in the .cu file): 3 with one consumer warpgroup up to
    BT 64 (2 for the stream-K kernel at BT 64), else 1."""
    if nwg == 1 and bt <= 64:
        return 2 if stream_k and bt == 64 else CTAS_PER_SM_SMALL_BT
    return 1


def stream_k_split(tiles: int, chunks: int, ctas: int, whole: int = 0) -> tuple[int, int, int]:
    """(q, r, x) of the partition of tiles * chunks / 2 chunk-pair units over `ctas` CTAs in order (SkSplit
    and the launch in the .cu file): the first r CTAs q + x units, the rest q. whole = 0: stream-K's even
    split (x = 1); else the tail split: `whole` CTAs of one whole tile each, then the other tiles in
    (ctas - whole) / (tiles - whole) pieces each."""
    per_tile = chunks // 2
    if whole:
        q = per_tile // ((ctas - whole) // (tiles - whole))
        return q, whole, per_tile - q
    units = tiles * per_tile
    return units // ctas, units % ctas, 1


def tail_split(tiles: int, slots: int, pieces: int) -> tuple[int, int]:
    """(CTAs, whole-tile CTAs) of the tail split: the tiles of the full waves of `slots` CTAs one CTA each,
    the last part-empty wave's tiles `pieces` CTAs each (where the tiles fill whole waves or one part-empty
    wave: all but the last tile whole; a single tile is stream-K's even split of it)."""
    rest = tiles % slots if tiles > slots else 0
    whole = tiles - rest if rest else tiles - 1
    return whole + (tiles - whole) * pieces, whole


def stream_k_segments(
    tiles: int, chunks: int, ctas: int, whole: int = 0
) -> list[list[tuple[int, int, int, int, int]]]:
    """Each CTA's segments as the kernel walks them (for_each_sk_segment and SkSplit::piece): (tile, first
    chunk, end chunk, piece index in the tile, pieces of the tile); `whole` as in `stream_k_split`."""
    q, r, x = stream_k_split(tiles, chunks, ctas, whole)
    per_tile = chunks // 2

    def begin(b: int) -> int:
        return b * q + min(b, r) * x

    def owner(u: int) -> int:
        big = r * (q + x)
        return u // (q + x) if u < big else r + (u - big) // q

    out = []
    for b in range(ctas):
        segs, u = [], begin(b)
        while u < begin(b + 1):
            tile = u // per_tile
            p_lo = u - tile * per_tile
            p_hi = min(per_tile, p_lo + begin(b + 1) - u)
            first = owner(tile * per_tile)
            nseg = owner(tile * per_tile + per_tile - 1) - first + 1
            segs.append((tile, 2 * p_lo, 2 * p_hi, b - first, nseg))
            u += p_hi - p_lo
        out.append(segs)
    return out


def stream_k_max_pieces(tiles: int, chunks: int, ctas: int, whole: int = 0) -> int:
    """An upper bound on the CTAs sharing one tile (the partials' workspace depth): a tile's chunks / 2
    units meet at most ceil(units / q) + 1 ranges of >= q units (the tail split: exactly its pieces)."""
    q, _, _ = stream_k_split(tiles, chunks, ctas, whole)
    if whole:
        return (ctas - whole) // (tiles - whole)
    return min(ctas, -(-(chunks // 2) // q) + 1)


def stream_k_slots(bt: int, nwg: int, sms: int, stages: int) -> int:
    """CTA slots of one wave of the segment kernel: its CTAs an SM, fewer where rings of `stages` slots do
    not fit the SM's shared memory together."""
    return max(1, min(ctas_per_sm(bt, nwg, True), SM_SMEM // smem_bytes(bt, nwg, stages))) * sms


def stream_k_ctas(bt: int, tiles: int, chunks: int, sms: int, stages: int = 2) -> int:
    """The stream-K grid: one wave of CTA slots (`stream_k_slots`), at most one CTA per SK_MIN_PAIRS chunk
    pairs."""
    return max(1, min(stream_k_slots(bt, 1, sms, stages), tiles * (chunks // 2) // SK_MIN_PAIRS))


def sm90_config(m: int, n: int, k: int, sms: int, stream_k: bool | None = None) -> tuple[int, int, int, int]:
    """(BT, consumer warpgroups, split_k, stages) for M rows of an N x K weight on `sms` SMs; stream_k:
    whether stream-K and the tail split may be chosen (None: stream-K up to K3RUN_SM90_STREAM_K rows, the
    tail split under K3RUN_SM90_TAIL_SPLIT).

    Up to TWO_WG_ABOVE_M rows one consumer warpgroup (64 weight rows a CTA) over the smallest token tile
    >= M; above, and at BT 128 where one warpgroup's tiles outnumber the SMs, two (128 weight rows) over
    128-token tiles (with the tensor producer 1.12-1.15x one warpgroup's 256-token tile at 256 rows and
    1.17x two one-warpgroup CTAs an SM at 128 rows of 12288x7168, on an H100; one warpgroup is as fast or
    faster at 16-64 rows and where its tiles fit one wave; see TWO_WG_ABOVE_M);
    up to BT 64 three CTAs an SM (the kernel's register cap allows them), one above; the largest split_k
    dividing the chunks that keeps the grid within one wave, where from BT 64 the wave is one CTA an SM
    if that fills SM_FILL of the SMs (with the tensor producer one CTA's deep ring beat three shallow ones:
    7168^2 at 64 rows 25.0 against 29.6 us on an H100); the deepest ring (<= 8 slots) whose CTAs fit the
    SM's shared memory together, counting the CTAs an SM actually holds (ceil(grid / SMs)), 4 slots at most
    with two warpgroups (TWO_WG_STAGES); bench/RESULTS.md.
    With stream-K allowed, where that grid fills under SK_BELOW_FILL of its waves' slots
    (one wave part-empty, or a last wave part-empty) and the chunk count is even, split_k 0: stream-K over
    one wave (`stream_k_ctas`). Allowed up to K3RUN_SM90_STREAM_K rows (default 0, never): on an H100 it
    ran 1.08-1.25x the thread producer's fixed grid at 16 rows, but the tensor producer's fixed grid
    matches or beats it (0.98-1.10x at 16-32 rows), and stream-K's CTAs feed on the thread form.
    With the tail split allowed, two warpgroups' fixed grid of more than one wave whose last wave is at
    most half full (TAIL_BELOW_FILL), an even chunk pair count: split_k -TAIL_PIECES, the last wave's tiles
    in TAIL_PIECES pieces (`tail_split`; 12288 x 7168 at 129-256 rows: 192 tiles on 132 SMs, 1.07-1.09x
    the fixed grid on an H100; on by default, K3RUN_SM90_TAIL_SPLIT).
    With K3RUN_SM90_THREE_WG (on by default), above 128 rows three consumer warpgroups (192 weight rows a
    CTA, the fixed grid) where their waves take no longer than two warpgroups' (`three_wg_pays`)."""
    three = knobs().sm90_three_wg
    if stream_k is None:
        return _sm90_config(m, n, k, sms, m <= knobs().sm90_stream_k, knobs().sm90_tail_split, three)
    return _sm90_config(m, n, k, sms, stream_k, stream_k, three)


def three_wg_pays(m: int, n: int, sms: int) -> bool:
    """Whether three consumer warpgroups' tiles (192 weight rows x 128 tokens, the fixed grid) take no longer
    than two warpgroups' (128 x 128), counted in waves of `sms` CTAs times the rows a tile (a wave of
    three-warpgroup tiles takes ~1.5x a wave of two-warpgroup ones at the same clock), with two warpgroups'
    grid at its tail split where that applies (a last wave at most half full: half a wave); on a tie, where
    N is a multiple of 192 (no tile's rows wasted), three: each CTA's x then serves 1.5x the rows. Measured
    on an H100 (bench/RESULTS.md), 12288 x 7168: at 256 rows one wave of 128 CTAs against 1.5 waves, 70.2
    against 89.6 us; at 512 / 1024 rows (ties) 143-144 / 297-301 against 155-156 / 313-319; 7168 x 12288 at
    4096 rows (7168 rows: 38 tiles of 192, the last a third full) 1284.2 against 1188.5."""
    t_tiles = -(-m // 128)
    tiles2, tiles3 = -(-n // 128) * t_tiles, -(-n // 192) * t_tiles
    waves2 = tiles2 // sms + 0.5 if _tail_wave(tiles2, sms) else -(-tiles2 // sms)
    cost2, cost3 = 2 * waves2, 3 * -(-tiles3 // sms)
    return cost3 < cost2 or (cost3 == cost2 and n % 192 == 0)


@functools.cache
def _sm90_config(
    m: int, n: int, k: int, sms: int, stream_k: bool, tail: bool, three: bool = False
) -> tuple[int, int, int, int]:
    chunks = -(-k // 128)
    # above 128 rows, and at BT 128 where one warpgroup's tiles outnumber the SMs: 128-token tiles of two
    # consumer warpgroups (128 weight rows a CTA); with `three` above 128 rows, three where that pays
    bt = next(b for b in TOKEN_TILES if b >= min(m, 128))
    nwg = 2 if m > TWO_WG_ABOVE_M or (bt == 128 and -(-n // 64) > sms) else 1
    if three and m > TWO_WG_ABOVE_M and three_wg_pays(m, n, sms):  # BT 128, two warpgroups so far
        nwg = 3
    tiles = -(-n // (64 * nwg)) * -(-m // bt)

    def fit(per_sm: int) -> int:  # CTAs an SM whose rings of two slots fit its shared memory
        while per_sm > 1 and per_sm * smem_bytes(bt, nwg, 2) > SM_SMEM:
            per_sm -= 1
        return per_sm

    per_sm = fit(ctas_per_sm(bt, nwg))
    # split_k: the most CTAs within one wave of per_sm an SM; from BT 64 within one CTA an SM where that
    # still fills SM_FILL of the SMs (with the tensor producer one CTA's deeper ring beat more CTAs' shallow
    # rings: 7168^2 at 64 rows 25.0 us against 29.6 on an H100)
    one = [d for d in _divisors(chunks) if tiles * d <= sms]
    within = [d for d in _divisors(chunks) if tiles * d <= per_sm * sms]
    if bt >= 64 and (not one or tiles * max(one) >= SM_FILL * sms):
        within = one
    split = max(within) if within else 1
    per_cta = chunks // split
    resident = min(per_sm, -(-tiles * split // sms))  # CTAs an SM actually holds: the ring's depth follows
    if (
        stream_k
        and nwg == 1  # the stream-K kernel has one consumer warpgroup
        and chunks % 2 == 0
        and tiles * split < SK_BELOW_FILL * per_sm * sms * -(-tiles * split // (per_sm * sms))
        and tiles * chunks // 2 >= SK_MIN_PAIRS
    ):
        per_sm = fit(ctas_per_sm(bt, nwg, True))
        split, per_cta = 0, -(-tiles * chunks // stream_k_ctas(bt, tiles, chunks, sms))
        resident = per_sm
    slots = per_sm * sms
    if (
        tail
        and nwg == 2
        and split == 1
        and _tail_wave(tiles, slots)
        and chunks % 2 == 0
        and (chunks // 2) % TAIL_PIECES == 0
    ):
        split = -TAIL_PIECES  # the whole tiles' ring depth (per_cta) stays
    stages = 2
    while (
        stages < (TWO_WG_STAGES if nwg >= 2 else 8)
        and stages < per_cta + 2
        and smem_bytes(bt, nwg, stages + 1) <= SMEM_LIMIT
        and resident * smem_bytes(bt, nwg, stages + 1) <= SM_SMEM
    ):
        stages += 1
    return bt, nwg, split, stages


# the tail split (K3RUN_SM90_TAIL_SPLIT): pieces a last-wave tile is cut into, and the most a last wave may be
# filled for it: with the last wave at most half full its tiles' pieces still run in one wave
TAIL_PIECES = 2
TAIL_BELOW_FILL = 0.5


def _tail_wave(tiles: int, slots: int) -> bool:
    """Whether `tiles` one CTA each fill more than one wave of `slots` with a last wave at most
    TAIL_BELOW_FILL full: where the tail split may cut that wave's tiles in pieces."""
    return tiles > slots and 0 < tiles % slots <= TAIL_BELOW_FILL * slots


# the largest token tile the x gather takes: a consumer thread permutes each slot's row half (2 * BT <= 128)
GATHER_MAX_BT = 32


def pdl_helps(bt: int, nwg: int, stages: int) -> bool:
    """Whether K3RUN_SM90_PDL launches this config with PDL: where one CTA's ring takes more than half an
    SM's shared memory, so no CTA of the next call can sit beside a running one. On an H100 (7168^2, graphs
    of back-to-back calls, bench/RESULTS.md) PDL ran 1.06-1.09x plain at every such config and
    0.79-0.98x at the ones that leave room for a second CTA ((16,1,1,8), (64,1,1,4), (16,1,2,8)), where
    the next call's early CTAs share SMs with the running ones (1.15x at (32,1,2,6) is given up)."""
    return 2 * smem_bytes(bt, nwg, stages) > SM_SMEM


def config_ok(bt: int, nwg: int, split: int, stages: int, chunks: int) -> bool:
    """A launch the kernel has: an instantiated (BT, warpgroups) pair (three warpgroups: BT 128 and split_k
    >= 1 only), split_k dividing the chunks (or 0: stream-K, one warpgroup, an even chunk count; or -s: the
    tail split in s pieces, s dividing the chunk pairs, one warpgroup or two at BT 128), a ring of >= 2
    slots within the shared memory."""
    pair = bt in TOKEN_TILES and nwg in WARPGROUPS and not (nwg == 2 and bt > 128) and (nwg < 3 or bt == 128)
    if nwg == 3 and split < 1:
        return False  # three warpgroups: the fixed grid only
    if split == 0:
        splits_ok = nwg == 1 and chunks % 2 == 0
    elif split < 0:
        pieces = -split
        pairs = chunks // 2
        splits_ok = (nwg == 1 or bt == 128) and chunks % 2 == 0 and pieces >= 2 and pairs % pieces == 0
    else:
        splits_ok = split >= 1 and chunks % split == 0
    return pair and splits_ok and stages >= 2 and smem_bytes(bt, nwg, stages) <= SMEM_LIMIT


def _check_inputs(x, weight, scale_u8, global_scale, k: int, n: int, bias) -> None:
    from .tile import _check_bias, _check_half_x, _check_tiled

    _check_half_x(x, k, "nvfp4 sm90 gemm")
    if _module is None:
        raise RuntimeError("nvfp4 sm90 gemm: call available() first")
    n_pad, k_pad = weight.shape[0], weight.shape[1] * 2
    _check_tiled(weight, scale_u8, global_scale, k, n, n_pad, k_pad, "nvfp4 sm90 gemm")
    _check_bias(bias, n, "nvfp4 sm90 gemm", x.dtype)  # the kernel reads the bias as the output type


def nvfp4_sm90_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
    sk_ctas: int | None = None,
    sk_whole: int | None = None,
    producer: str | None = None,
    pdl: bool | None = None,
    gather: bool | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, k] @ W^T * global_scale (+ bias) in x's dtype (bf16 / fp16 on sm_90); W in the
    tiled128 layout (uint8 [N_pad, K_pad/2], scales [N_pad, K_pad/16]), global_scale fp32 [1] or [N_pad].
    config: (BT in 16..256, consumer warpgroups 1 | 2, split_k dividing the 128-wide chunks, 0 for
    stream-K over `stream_k_ctas` CTAs, or -s for the tail split (`tail_split`: the first wave's CTAs a
    whole tile each, the other tiles in s pieces), stages >= 2); default `sm90_config`. sk_ctas: stream-K's
    CTA count instead (1 .. the tiles' chunk pairs), sk_whole: the tail split's whole-tile CTAs instead (0 ..
    tiles - 1; tests and benches). producer: how the ring is fed, one of
    PRODUCERS or auto (None: K3RUN_SM90_PRODUCER); the same bytes into the same slots whichever. pdl: both
    launches with programmatic dependent launch (None: K3RUN_SM90_PDL where `pdl_helps`); the same result
    either way. gather: the GEMM copies x itself (its consumers permute it), with no prep_x launch, where the
    launch allows it (the fixed grid, one consumer warpgroup, BT <= GATHER_MAX_BT, the warp or tensor
    producer, 16-byte aligned rows of x; None: up to K3RUN_SM90_X_GATHER rows); the same bits either way.
    Call `available(x.device)` first."""
    from k3run.kernels.counters import counters

    from . import sm_count

    _check_inputs(x, weight, scale_u8, global_scale, k, n, bias)
    m, chunks = x.shape[0], weight.shape[1] // 64
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bt, nwg, split, stages = config or sm90_config(m, n, k, sm_count(x.device.index or 0))
    if not config_ok(bt, nwg, split, stages, chunks):
        raise ValueError(f"nvfp4 sm90 gemm: bad config {(bt, nwg, split, stages)} for {chunks} chunks")
    if x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    if pdl is None:
        pdl = knobs().sm90_pdl and pdl_helps(bt, nwg, stages)
    name = producer or knobs().sm90_producer
    if gather is None:
        gather = m <= knobs().sm90_x_gather
    # the x gather: the fixed grid, one warpgroup, BT <= 32, the warp or tensor producer, 16-byte rows
    gather = (
        gather
        and split > 0
        and nwg == 1
        and bt <= GATHER_MAX_BT
        and _producer(name, 0) != "thread"
        and k % 8 == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
    )
    xt = x if gather else _module.w4a16_prep_x(x, bt, chunks, pdl)
    tiles = -(-n // (64 * nwg)) * -(-m // bt)
    sk = whole = 0
    if split == 0:
        sk = sk_ctas or stream_k_ctas(bt, tiles, chunks, sm_count(x.device.index or 0), stages)
        if not 1 <= sk <= tiles * (chunks // 2):
            raise ValueError(f"nvfp4 sm90 gemm: {sk} stream-K CTAs for {tiles * (chunks // 2)} chunk pairs")
    elif split < 0:
        slots = stream_k_slots(bt, nwg, sm_count(x.device.index or 0), stages)
        sk, whole = tail_split(tiles, slots, -split)
        if sk_whole is not None:
            if not 0 <= sk_whole < tiles:
                raise ValueError(f"nvfp4 sm90 gemm: {sk_whole} whole-tile CTAs for {tiles} tiles")
            whole, sk = sk_whole, sk_whole + (tiles - sk_whole) * -split
    depth = stream_k_max_pieces(tiles, chunks, sk, whole) if sk else split  # partials a tile can have
    if depth > 1:
        ws = torch.empty((depth * tiles * nwg * 128 * bt // 2,), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, tiles)
    else:
        ws = cnt = global_scale
    form = PRODUCERS.index(_producer(name, sk, nwg))
    args = (m, n, bt, nwg, max(split, 0), stages, form, gather, whole, sk, pdl)
    _module.w4a16_gemm(xt, weight, scale_u8, global_scale, bias, y, ws, cnt, *args)
    return y


# the decode GEMV in this extension (gemv_kernel in the .cu file): up to this many rows, K a multiple of 128;
# its modes (GEMV_* in the .cu file): dense, one routed pick a program group, one expert group a program group
GEMV_MAX_M = 16
GEMV_DENSE, GEMV_PICKS, GEMV_GROUPS = 0, 1, 2


def gemv_takes(m: int, k: int) -> bool:
    """Whether nvfp4_linear may run m rows of a K-wide tiled128 weight on the CUDA decode GEMV (up to
    K3RUN_SM90_GEMV rows, at most GEMV_MAX_M; its x loads need K = the chunks * 128); `available` still
    decides whether it can."""
    return 1 <= m <= min(GEMV_MAX_M, knobs().sm90_gemv) and k % 128 == 0


def experts_take(x: torch.Tensor, inter: int, bt: int, act) -> bool:
    """Whether the routed experts' decode launches run on the CUDA GEMV (K3RUN_SM90_GEMV_EXPERTS): 16-bit x
    on sm_90 with both GEMMs' K (x's width, the intermediate size `inter`) multiples of 128, a token tile of
    8 or 16, the activation epilogue only at 8."""
    return (
        knobs().sm90_gemv_experts
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[1] % 128 == 0
        and inter % 128 == 0
        and bt in (8, 16)
        and (act is None or bt == 8)
        and available(x.device)
    )


def _launch_gemv(x, weight, scale_u8, global_scale, y, *, split_k, bias=None, mode=GEMV_DENSE, ids=None,
                 items=1, bt=8, slot_div=1, rows, act=None, pdl=True) -> None:  # fmt: skip
    """One launch of the .cu file's w4a16_gemv (split-K partials and counters per program group); the
    activation's code and betas as the Gluon launches take them (the kernel forms their reciprocals)."""
    from k3run.kernels.counters import counters

    from .gluon_gemv import _act_args

    kw = _act_args(act, rows)
    code, beta, lbeta = kw.get("ACT", 0), kw.get("act_beta", 1.0), kw.get("act_lbeta", 1.0)
    row_blocks = rows // 16 if act is not None else -(-rows // 16)
    if split_k > 1:
        ws = torch.empty((items * split_k * row_blocks * 16 * bt,), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, items * row_blocks)
    else:
        ws = cnt = global_scale
    args = (split_k, pdl, mode, ids, items, bt, slot_div, rows, code, beta, lbeta)
    _module.w4a16_gemv(x, weight, scale_u8, global_scale, bias, y, ws, cnt, *args)


def nvfp4_sm90_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_u8: torch.Tensor,
    global_scale: torch.Tensor,
    k: int,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    split_k: int = 1,
    pdl: bool | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, k] @ W^T * global_scale (+ bias) for 1..GEMV_MAX_M rows of bf16 / fp16 x on sm_90,
    in one launch of the CUDA decode GEMV (the .cu file's gemv_kernel: mma.sync on operands loaded straight
    into registers, one warp a 16-row block); W tiled128 as for nvfp4_sm90_gemm, k a multiple of 128. The
    same roundings as the decode kernels (exact decoded weights, fp32 sums, split-K partials added in split
    order, one rounding), though not their summation order. split_k must divide the k / 128 chunks. pdl:
    programmatic dependent launch (None: on). Call `available(x.device)` first."""
    _check_inputs(x, weight, scale_u8, global_scale, k, n, bias)
    m = x.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"nvfp4 sm90 gemv: takes 1..{GEMV_MAX_M} rows, got M={m}")
    x = _gemv_input(x)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch_gemv(x, weight, scale_u8, global_scale, y, split_k=split_k, bias=bias, bt=8 if m <= 8 else 16,
                 rows=n, pdl=True if pdl is None else pdl)  # fmt: skip
    return y


def _gemv_input(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMV's 16-byte loads read it: K a multiple of 128 (else a ValueError), rows 16-byte aligned
    with unit stride (else a contiguous copy)."""
    if x.shape[1] % 128:
        raise ValueError(f"nvfp4 sm90 gemv: K={x.shape[1]} must be a multiple of 128")
    return x if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 else x.contiguous()


def nvfp4_sm90_gemv_grouped(
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
    act=None,
    early_ids: bool = False,
) -> torch.Tensor:
    """`gluon_gemv.nvfp4_gemv_grouped` (one routed pick a program group: y row s = x[s // (P / T)] @
    W[ids[s]]^T * global_scale[ids[s]], zero for another rank's id; with `act` h = act(gate, up)) on the
    CUDA GEMV; the same operands and checks, K a multiple of 128 (maxnreg: the Gluon call's, not used: the
    CUDA kernel's registers are fixed when it is built; early_ids: a permission, not used: the CUDA kernel
    always waits before reading the ids, which is right either way). Call `available(x.device)` first."""
    from .gluon_gemv import _check_grouped_operands, check_picks

    _, pdl = _check_grouped_operands(x, weight, scale_u8, global_scale, rows, pdl)
    picks, t = check_picks(x, ids)
    y = torch.empty((picks, rows // 2 if act else rows), dtype=x.dtype, device=x.device)
    if picks:
        _launch_gemv(_gemv_input(x), weight, scale_u8, global_scale, y, split_k=split_k, mode=GEMV_PICKS,
                     ids=ids.contiguous(), items=picks, bt=8, slot_div=picks // t, rows=rows, act=act,
                     pdl=pdl)  # fmt: skip
    return y


def nvfp4_sm90_gemv_by_expert(
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
    act=None,
    early_table: bool = False,
) -> torch.Tensor:
    """`gluon_gemv.nvfp4_gemv_by_expert` (one program group a group of `expert_groups`' table, BT 8 or 16;
    the activation epilogue at BT 8) on the CUDA GEMV; the same operands and checks, K a multiple of 128
    (maxnreg and early_table: not used, as maxnreg and early_ids in `nvfp4_sm90_gemv_grouped`). Call
    `available(x.device)` first."""
    from .gluon_gemv import _check_grouped_operands, by_expert_output

    _, pdl = _check_grouped_operands(x, weight, scale_u8, global_scale, rows, pdl)
    bt = groups.shape[1] - 1 if groups.dim() == 2 else 0
    if groups.dtype != torch.int32 or bt not in (8, 16) or not groups.is_contiguous() or (act and bt != 8):
        raise ValueError(
            f"nvfp4 sm90 by-expert groups: expected contiguous int32 [G, 9] or [G, 17] (the activation: [G, "
            f"9]), got {groups.dtype} {tuple(groups.shape)}"
        )
    y = by_expert_output(x, picks, slot_div, rows, act is not None, all_in_groups)
    if picks and groups.shape[0]:
        _launch_gemv(_gemv_input(x), weight, scale_u8, global_scale, y, split_k=split_k, mode=GEMV_GROUPS,
                     ids=groups, items=groups.shape[0], bt=bt, slot_div=slot_div, rows=rows, act=act,
                     pdl=pdl)  # fmt: skip
    return y
