"""NVFP4 and FP8_PB_WO GEMVs on x86 CPUs with AVX-512 or AVX2: a small C++ extension, built once at first use.

The torch.compile'd loop of nvfp4_gemm/cpu.py decodes each 4-bit code with ~6 vector integer operations
(Inductor cannot turn a 16-entry table into a register permute). AVX-512 decodes 16 codes with one `vpermps`
from a register holding the 16 E2M1 values, so a 16-byte chunk of packed weights (32 weights, two scale
groups) costs: one widening load, an AND and a shift for the two nibbles, two permutes, two multiplies by the
chunk's two group scales (E4M3 through a 256-entry fp32 table), and one FMA per nibble half and token row.
AVX2's 8-lane `vpermps` holds the 8 magnitudes, and the sign bit is moved into place by a shift and a mask:
an 8-byte chunk (16 weights, one scale group) costs a widening load, a shift, two permutes, two sign
shifts + masks + XORs, two multiplies and the FMAs. Rows of W are spread over torch's intra-op threads.

    y[m, n] = gs[n] * sum_j (e2m1(lo_j) * s[n, j // 8] * x[m, 2j] + e2m1(hi_j) * s[n, j // 8] * x[m, 2j + 1])

over the packed bytes j of row n: the reference's products (e2m1 * E4M3 is exact in fp32) in another
summation order. `fp8_block_gemv` does the same for FP8_PB_WO (E4M3 bytes to fp16 bits by two masks and
shifts, then the hardware fp16 -> fp32 conversion (F16C on AVX2 machines); per-128 block sums scaled by the
two tile scales). Both instruction sets live in one source (per-function target attributes) and the level is
chosen per call: AVX-512 where torch reports it, else AVX2 (`cpu_level`; K3RUN_CPU_SIMD=avx2 forces AVX2,
K3RUN_CPU_SIMD=0 turns the extension off). Used by `nvfp4_linear_cpu` / `fp8_pb_wo_linear_cpu` up to
NVFP4_MAX_M / FP8_MAX_M rows (calls of `_chunk()` rows) when a C++ compiler builds the extension
(`available()`); otherwise the compiled loops run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from k3run.knobs import knobs

log = logging.getLogger(__name__)

# The extension's C++ (the AVX-512 / AVX2 kernels), beside this file and in the package data (pyproject.toml);
# read at build time. load_inline hashes the source text it is given, so an edited file builds a new version.
SOURCE_PATH = Path(__file__).with_name("cpu_simd.cpp")

# rows up to which the extension runs (in calls of 8 rows, each decoding the weight again); above, the
# compiled dequantization + matmul. Measured on 7168^2 with fp32 inputs, row blocks on (2-core AVX-512 box,
# bench/NOTES.md): NVFP4 calls of 8 rows 28 / 56 / 109 ms at 64 / 128 / 256 rows against 56 / 84 / 151 for
# dequantization + matmul; FP8 8.4 ms at 8 rows (compiled loop 30.5), 60 against 49 at 64 rows.
NVFP4_MAX_M = 256
FP8_MAX_M = 32
# rows per nvfp4_vnni_gemm call of a dense linear (K3RUN_CPU_INT8=1; more rows run in calls of this many): on
# this project's 2-core AVX-512 box 0.65-0.93x the bf16 dequantize + matmul path's time at 256-512 rows, ~260
# GMAC/s; one call of 2048 rows falls to ~210 (its activations overflow the L2)
INT8_MAX_M = 256
INT8_VBMI = True  # decode codes by vpermb where the CPU has AVX-512 VBMI (False: vpshufb, as without it)
INT8_PAIRS = True  # 2-4 tokens: two 16-row blocks per pass sharing the activation broadcasts (same bits)


def _int8_flags() -> int:
    """The int8 kernels' variant bits: 1 = no vpermb, 2 = one row block per pass."""
    return (0 if INT8_VBMI else 1) | (0 if INT8_PAIRS else 2)


_module = None
_error: str | None = None


def cpu_level() -> str | None:
    """The instruction set the kernels run with on this CPU: "avx512" where torch's own dispatch level is
    AVX-512 (F / BW / VL) or AMX, "avx2" where it is AVX2 (AVX2 + FMA; F16C comes with every such CPU), else
    None. K3RUN_CPU_SIMD=avx2 takes the AVX2 kernels on an AVX-512 CPU; K3RUN_CPU_SIMD=0 turns both off."""
    forced = knobs().cpu_simd
    if forced == "off":
        return None
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return None
    if cap in ("AVX512", "AMX") or cap.startswith("AVX512"):
        return "avx2" if forced == "avx2" else "avx512"
    return "avx2" if cap == "AVX2" else None


def cpu_supported() -> bool:
    """Whether this CPU runs one of the extension's instruction sets (`cpu_level`)."""
    return cpu_level() is not None


def _chunk() -> int:
    """Rows per kernel call: 8 with AVX-512's 32 registers, 4 with AVX2's 16."""
    return 8 if cpu_level() == "avx512" else 4


# a build lock older than this is left by a build that was killed (torch's FileBaton holds no PID and
# waits for the lock to go forever); a build of the extension takes ~30 s on 2 cores
STALE_BUILD_LOCK_S = 600


def _clear_stale_build_lock(name: str, poll_s: float = 1.0) -> None:
    """Wait while another process may be building `name` (its lock in torch's extension directory younger
    than STALE_BUILD_LOCK_S), then remove a lock that old: an interrupted build left it, and every later
    process would otherwise hang at its first CPU kernel call."""
    import time
    from pathlib import Path

    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    except (ImportError, OSError):  # a torch that places builds elsewhere: its own waiting applies
        return
    told = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # no lock (the usual case), or the other build finished
            return
        if age > STALE_BUILD_LOCK_S:
            log.warning("removing %s: a build lock %.0f s old, left by an interrupted build", lock, age)
            lock.unlink(missing_ok=True)
            return
        if not told:
            log.warning("waiting for another process's build of the CPU kernels (lock %s)", lock)
            told = True
        time.sleep(poll_s)


def available() -> bool:
    """The extension is built (building it now on first call) and the CPU runs it (`cpu_level`)."""
    global _module, _error
    if _error is not None or not cpu_supported():
        return False
    if _module is None:
        try:
            from torch.utils.cpp_extension import load_inline

            log.info("building the AVX-512 / AVX2 CPU kernels (once per machine, ~30 s; cached after)")
            _clear_stale_build_lock("k3run_cpu_simd")
            names = ["nvfp4_gemv", "fp8_block_gemv", "nvfp4_dequant_bf16_perm", "has_vnni",
                     "nvfp4_vnni_quant", "nvfp4_vnni_gemm", "kda_decode_step", "bf16_gemv",
                     "nvfp4_vnni_grouped", "kda_prefill_recurrent", "conv_decode_in_place",
                     "moe_combine", "conv_prefill", "mla_decode_chunks"]  # fmt: skip
            _module = load_inline(
                name="k3run_cpu_simd", cpp_sources=SOURCE_PATH.read_text(), functions=names,
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
            )  # fmt: skip
        except Exception as e:  # no compiler, no ninja, an old toolchain: the compiled loop instead
            _error = f"{type(e).__name__}: {e}"
            log.warning("the SIMD CPU kernels could not be built; using the compiled loops: %s", _error)
            return False
    return True


_S_TABLE: torch.Tensor | None = None


def _scale_table() -> torch.Tensor:
    global _S_TABLE
    if _S_TABLE is None:
        _S_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return _S_TABLE


def nvfp4_gemv_simd(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequant(W)^T for M <= NVFP4_MAX_M (module docstring; `_chunk()` rows per
    call); weight uint8 [N, K/2],
    weight_scale float8_e4m3fn / uint8 [N, K/16], global_scale fp32 with one element or one per row.
    Call `available()` first."""
    assert _module is not None, "nvfp4_gemv_simd: call available() first"
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.uint8 or tuple(weight.shape) != (n, k // 2) or k % 16:
        raise ValueError(f"nvfp4_gemv_simd: weight uint8 [N, K/2] for K={k} (a multiple of 16), got "
                         f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    if tuple(weight_scale.shape) != (n, k // 16) or weight_scale.element_size() != 1:
        raise ValueError(f"nvfp4_gemv_simd: weight_scale [N, K/16] = {(n, k // 16)} of 1-byte E4M3, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")  # fmt: skip
    if not 1 <= m <= NVFP4_MAX_M:
        raise ValueError(f"nvfp4_gemv_simd: 1..{NVFP4_MAX_M} rows, got {m}")
    xf = x.detach().to(torch.float32)
    gs = global_scale.detach().to(torch.float32).reshape(-1).expand(n).contiguous()
    w, s = weight.detach().contiguous(), weight_scale.detach().contiguous().view(torch.uint8)
    xe, xo = xf[:, 0::2].contiguous(), xf[:, 1::2].contiguous()
    c, avx2 = _chunk(), cpu_level() == "avx2"
    parts = [
        _module.nvfp4_gemv(xe[i : i + c], xo[i : i + c], w, s, gs, _scale_table(), avx2)
        for i in range(0, m, c)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def int8_activations_enabled() -> bool:
    """K3RUN_CPU_INT8=1: NVFP4 linears on the CPU take the int8-activation kernel (`nvfp4_vnni_gemm`) where
    the CPU has AVX-512 VNNI. Off by default: it rounds activations to int8 per 16 columns (the other CPU
    paths are the fp32 reference's products in another order)."""
    return knobs().cpu_int8


def vnni_available() -> bool:
    """The extension is built (`available()`), the CPU has AVX-512 VNNI, and the level is not forced down."""
    return cpu_level() == "avx512" and available() and bool(_module.has_vnni())


@dataclass(frozen=True)
class Vnni16Weight:
    """An NVFP4 weight in the layout of `nvfp4_vnni_gemm` (see cpu_simd.cpp): weight uint8 [NB, K/16, 128],
    scale uint8 [NB, K/16, 16] (E4M3 bytes), global_scale fp32 [NB * 16] (per row, padded with ones); NB =
    ceil(N / 16), zero codes and zero scales in the padded rows."""

    weight: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    n: int


def nvfp4_vnni_pack(
    weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor
) -> Vnni16Weight:
    """The checkpoint layout (uint8 [N, K/2], low nibble = even column; E4M3 [N, K/16]; global scale with one
    element or N) -> `Vnni16Weight`. A copy: the checkpoint tensors are left as they are."""
    n, h = weight.shape
    k = 2 * h
    if weight.dtype != torch.uint8 or k % 16 or tuple(weight_scale.shape) != (n, k // 16):
        raise ValueError(
            f"nvfp4_vnni_pack: weight uint8 [N, K/2] with K a multiple of 16 and scales [N, K/16], got "
            f"{weight.dtype} {tuple(weight.shape)} and {tuple(weight_scale.shape)}"
        )
    g, nb = k // 16, -(-n // 16)
    pad = nb * 16 - n
    sb = weight_scale.view(torch.uint8)
    if bool(((sb & 0x7F) == 0x7F).any()):
        raise ValueError("nvfp4_vnni_pack: weight_scale holds E4M3 NaN (0x7F / 0xFF) bytes")
    codes = torch.stack([weight & 15, weight >> 4], dim=-1).reshape(n, k)  # the code of column k
    # a negative block scale flips its codes' signs instead (exact: -s * v = s * -v): the kernel's scales are
    # positive, converted by one shift
    codes = codes ^ ((sb >> 7) << 3).repeat_interleave(16, dim=1)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).view(nb, 16, g, 4, 4)  # [block, row, g, quad, j]
    packed = codes[:, :, :, 0::2] | (codes[:, :, :, 1::2] << 4)  # [block, row, g, chunk, j]
    packed = packed.permute(0, 2, 3, 1, 4).contiguous().view(nb, g, 128)
    scale = torch.nn.functional.pad(sb & 0x7F, (0, 0, 0, pad))
    scale = scale.view(nb, 16, g).transpose(1, 2).contiguous()
    gs = global_scale.detach().to(torch.float32).reshape(-1).expand(n)
    gs = torch.cat([gs, gs.new_ones(pad)]).contiguous()
    return Vnni16Weight(packed, scale, gs, n)


def nvfp4_vnni_unpack(weight: torch.Tensor, scale: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `nvfp4_vnni_pack` for the codes and scales: (uint8 [n, K/2], float8_e4m3fn [n, K/16]) in
    the checkpoint layout from weight uint8 [NB, K/16, 128] and scale uint8 [NB, K/16, 16]. A block whose
    scale was negative comes back with its codes' signs flipped and a positive scale: the same values."""
    nb, g = weight.shape[0], weight.shape[1]
    p = weight.reshape(nb, g, 2, 16, 4).permute(0, 3, 1, 2, 4)  # [block, row, g, chunk, j]
    codes = torch.stack([p & 15, p >> 4], dim=4).reshape(nb * 16, g * 16)[:n]  # quads 2c, 2c + 1
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scales = scale.reshape(nb, g, 16).transpose(1, 2).reshape(nb * 16, g)[:n].contiguous()
    return packed, scales.view(torch.float8_e4m3fn)


def nvfp4_vnni_gemm(x: torch.Tensor, w: Vnni16Weight) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ dequant(W)^T with x rounded to int8 per 16 columns (`nvfp4_vnni_quant`),
    exact integer dot products per scale group; INT8_MAX_M rows at a time inside the one call. Call
    `vnni_available()` first."""
    assert _module is not None, "nvfp4_vnni_gemm: call vnni_available() first"
    k = x.shape[1]
    if x.dim() != 2 or k != 16 * w.weight.shape[1]:
        raise ValueError(f"nvfp4_vnni_gemm: x [M, {16 * w.weight.shape[1]}], got {tuple(x.shape)}")
    xf = x.detach().to(torch.float32).contiguous()
    return _module.nvfp4_vnni_gemm(xf, w.weight, w.scale, w.global_scale, w.n, _int8_flags(), INT8_MAX_M)


def nvfp4_vnni_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation rounding of `nvfp4_vnni_gemm`: x fp32 [M, K] -> (int8 codes [M, K], fp32 scales
    [M, K/16]) with x ~= codes * scale per 16 columns (scale = amax / 127, codes rounded to nearest)."""
    assert _module is not None, "nvfp4_vnni_quant: call vnni_available() first"
    q, a = _module.nvfp4_vnni_quant(x.detach().to(torch.float32).contiguous())
    return q, a


def fp8_block_gemv_simd(
    q_x: torch.Tensor, scale_x: torch.Tensor, weight: torch.Tensor, scale_w: torch.Tensor
) -> torch.Tensor:
    """FP8_PB_WO for M <= FP8_MAX_M (`_chunk()` rows per kernel call): y [M, N] fp32 from the activation
    codes' values q_x fp32 [M, K] and their scales [M, K/128] (quantize_fp8_act_1x128), the weight's E4M3
    bytes [N, K] (float8_e4m3fn or uint8) and its tile scales fp32 [>= ceil(N/128), K/128]. Call
    `available()` first."""
    assert _module is not None, "fp8_block_gemv_simd: call available() first"
    m, k = q_x.shape
    n = weight.shape[0]
    if k % 128 or weight.element_size() != 1 or tuple(weight.shape) != (n, k):
        raise ValueError(f"fp8_block_gemv_simd: weight of 1-byte E4M3 [N, K] with K={k} a multiple of 128, "
                         f"got {weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    kb, nb = k // 128, -(-n // 128)
    bad_w = scale_w.dim() != 2 or scale_w.shape[0] < nb or scale_w.shape[1] != kb
    if bad_w or tuple(scale_x.shape) != (m, kb):
        raise ValueError(f"fp8_block_gemv_simd: scales [>= {nb}, {kb}] and [{m}, {kb}], got "
                         f"{tuple(scale_w.shape)} and {tuple(scale_x.shape)}")  # fmt: skip
    if not 1 <= m <= FP8_MAX_M:
        raise ValueError(f"fp8_block_gemv_simd: 1..{FP8_MAX_M} rows, got {m}")
    qx, sx = q_x.detach().to(torch.float32).contiguous(), scale_x.detach().to(torch.float32).contiguous()
    w, sw = weight.detach().contiguous().view(torch.uint8), scale_w.detach().to(torch.float32).contiguous()
    c, avx2 = _chunk(), cpu_level() == "avx2"
    parts = [_module.fp8_block_gemv(qx[i : i + c], sx[i : i + c], w, sw, avx2) for i in range(0, m, c)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def nvfp4_x_perm(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 32-column chunk reordered as its 16 even columns then its 16 odd ones (the column
    order of `nvfp4_dequant_bf16_perm`); K % 32 == 0."""
    m, k = x.shape
    return x.reshape(m, k // 32, 16, 2).transpose(-1, -2).reshape(m, k)


def nvfp4_dequant_bf16_perm(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """weight uint8 [N, K/2] and E4M3 block scales [N, K/16] -> bf16 [N, K]: codes times block scales,
    exactly, columns in `nvfp4_x_perm` order (no global scale). Call `available()` first."""
    assert _module is not None, "nvfp4_dequant_bf16_perm: call available() first"
    n, h = weight.shape
    if weight.dtype != torch.uint8 or h % 16 or tuple(weight_scale.shape) != (n, h // 8):
        raise ValueError(
            f"nvfp4_dequant_bf16_perm: weight uint8 [N, K/2] with K a multiple of 32 and scales [N, K/16], "
            f"got {weight.dtype} {tuple(weight.shape)} and {tuple(weight_scale.shape)}"
        )
    w, s = weight.detach().contiguous(), weight_scale.detach().contiguous().view(torch.uint8)
    return _module.nvfp4_dequant_bf16_perm(w, s, _scale_table(), cpu_level() == "avx2")


def kda_decode_step(
    q_scaled: torch.Tensor,
    k_normed: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One KDA decode token per sequence with the states updated in place (see cpu_simd.cpp):
    q_scaled = l2norm(q) * scale, k_normed = l2norm(k), decay = exp(g) [B, H, K] fp32, v [B, H, V] fp32,
    beta [B, H] fp32, state_pool [S, H, K, V] fp32 contiguous, slots / context_lens [B] (distinct slots;
    context 0 starts from a zero state). Returns o [B, H, V] fp32. Call `available()` first."""
    assert _module is not None, "kda_decode_step: call available() first"
    return _module.kda_decode_step(q_scaled, k_normed, v, decay, beta, state_pool, slots, context_lens)


def kda_prefill_recurrent(
    q_scaled: torch.Tensor,
    k_normed: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """Varlen KDA over whole prompts, token by token (the recurrent reference's operations): q_scaled,
    k_normed, decay (exp of the log decay) [T, H, K], v [T, H, V], beta [T, H] (post-sigmoid), all fp32
    contiguous; state [B, H, K, V] fp32, the initial states, overwritten with the final ones; cu_seqlens
    [B + 1]. Returns o [T, H, V] fp32. Call `available()` first."""
    assert _module is not None, "kda_prefill_recurrent: call available() first"
    return _module.kda_prefill_recurrent(q_scaled, k_normed, v, decay, beta, state, cu_seqlens)


def conv_decode_in_place(
    x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """The KDA short conv for one token per sequence, windows in the cache pool updated in place: x [B, C]
    (fp32 or bf16, unit stride along C), weight [C, W] fp32, pool [S, C, W - 1] in x's dtype. Returns the
    pre-activation sums [B, C] fp32, bit for bit causal_conv1d_decode_ref's. Call `available()` first."""
    assert _module is not None, "conv_decode_in_place: call available() first"
    return _module.conv_decode_in_place(x, weight, pool, slots, context_lens)


BF16_MAX_M = 8  # rows up to which bf16_gemv runs
# smaller bf16 matrices stay on torch's matmul (cache-resident, its call is cheaper)
BF16_MIN_WEIGHTS = 1 << 20


def bf16_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `bf16_gemv` takes x @ weight^T: CPU, bf16 weight of >= BF16_MIN_WEIGHTS, x of <= BF16_MAX_M
    rows, AVX-512 and the extension built, outside a compiled step (an extension call is not traceable)."""
    return (
        not x.is_cuda
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.numel() >= BF16_MIN_WEIGHTS
        and x.dim() >= 1
        and x.numel() // max(x.shape[-1], 1) <= BF16_MAX_M
        and not torch.compiler.is_compiling()
        and cpu_level() == "avx512"
        and available()
    )


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y fp32 [M, N] = x [M, K] @ weight^T for a bf16 weight [N, K] (exact products, fp32 sums); M <= 8.
    Check `bf16_gemv_applies` first."""
    assert _module is not None, "bf16_gemv: call available() first"
    return _module.bf16_gemv(x.detach().to(torch.float32).contiguous(), weight.detach().contiguous())


def nvfp4_vnni_grouped(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    offsets: torch.Tensor, n: int, rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`nvfp4_vnni_gemm` for rows grouped by expert: rows offsets[e] .. offsets[e + 1] - 1 through expert e
    of stacked vnni16 weights (weight uint8 [E, NB, K/16, 128], scale uint8 [E, NB, K/16, 16], global_scale
    fp32 [E, NB * 16]). The rows are x's [P, K], or with `rows` (int64 [P]) x[rows] for x [T, K]: each of x's
    rows is then rounded to int8 once and the rounded rows gathered (the same bits as passing x[rows]).
    Each row's result equals that expert's nvfp4_vnni_gemm of the row alone. y fp32 [P, n]. Call
    `vnni_available()` first."""
    assert _module is not None, "nvfp4_vnni_grouped: call vnni_available() first"
    xf = x.detach().to(torch.float32).contiguous()
    r = rows.to(torch.int64) if rows is not None else torch.empty(0, dtype=torch.int64)
    return _module.nvfp4_vnni_grouped(xf, weight, scale, global_scale, offsets, n, _int8_flags(), r)


_COMBINE_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def moe_combine(
    out: torch.Tensor, y: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
) -> None:
    """out[tok[p]] += y[p].to(dtype).float() * w[p] for p in order, in place: the bits of
    `out.index_add_(0, tok, y.to(dtype).float() * w[:, None])` (the routed experts' weighted sum) in one pass
    over y. out fp32 [T, D], y fp32 [P, D], tok int64 [P], w fp32 [P]; dtype fp32, bf16 or fp16. Call
    `available()` first."""
    assert _module is not None, "moe_combine: call available() first"
    if dtype not in _COMBINE_ROUND:
        raise ValueError(f"moe_combine: dtype must be one of {list(_COMBINE_ROUND)}, got {dtype}")
    tok, w = tok.to(torch.int64).contiguous(), w.to(torch.float32).contiguous()
    _module.moe_combine(out, y.contiguous(), tok, w, _COMBINE_ROUND[dtype])


def conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA short conv over prompts before its SiLU: acc fp32 [T, C] with acc[t] = sum_j w[:, j] *
    window[t + j] (the reference's products and additions in its order), and the new states [B, C, W-1] in
    x's dtype. x fp32 / bf16 [T, C] with unit column stride (a column slice is fine), weight fp32 [C, W],
    cu_seqlens [B + 1], initial_state [B, C, W-1] or None (fresh). Call `available()` first."""
    assert _module is not None, "conv_prefill: call available() first"
    init = (
        initial_state.to(x.dtype).contiguous() if initial_state is not None else torch.empty(0, dtype=x.dtype)
    )
    acc, final = _module.conv_prefill(x, weight.to(torch.float32).contiguous(), cu_seqlens, init)
    return acc, final


# the fewest cached positions a chunk of `mla_decode` takes (each chunk's [H, L] accumulator is merged after)
MLA_MIN_CHUNK = 256


def mla_decode_applies(q: torch.Tensor, lat: torch.Tensor, L: int) -> bool:
    """Whether `mla_decode` takes one query row's absorbed attention: CPU, bf16 latents with a unit column
    stride, widths that are multiples of 16, outside a compiled step, the extension built."""
    return (
        not q.is_cuda
        and lat.dtype == torch.bfloat16
        and lat.dim() == 2
        and lat.stride(1) == 1
        and q.dim() == 2
        and q.shape[1] == lat.shape[1]
        and q.shape[1] % 16 == 0
        and L % 16 == 0
        and lat.shape[0] >= 1
        and not torch.compiler.is_compiling()
        and available()
    )


def mla_decode(q: torch.Tensor, lat: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """One query row's absorbed MLA attention over all N cached positions: q [H, J] (the absorbed query
    joined with the RoPE query), lat bf16 [N, J] (read in place) -> softmax(q . lat^T * scale) . lat[:, :L],
    fp32 [H, L]. The positions go in chunks over the threads, each an online softmax with fp32 FMAs on the
    widened rows; the chunks merge by their maxima. Check `mla_decode_applies` first."""
    assert _module is not None, "mla_decode: call available() first"
    n = lat.shape[0]
    chunk = max(MLA_MIN_CHUNK, -(-n // (4 * torch.get_num_threads())))
    qf = q.detach().to(torch.float32).contiguous()
    avx2 = cpu_level() == "avx2"
    top, sums, acc = _module.mla_decode_chunks(qf, lat.detach(), L, float(scale), chunk, avx2)
    w = torch.exp(top - top.max(0).values)  # [C, H]: each chunk's weight against the overall maximum
    return (acc * w[..., None]).sum(0) / (sums * w).sum(0)[:, None]
