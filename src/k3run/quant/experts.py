"""The routed experts' formats as schemes: parameters, checkpoint checks, processing after loading, one
expert's forward and the sync-free grouped launches over every pick.

A scheme owns the *numerics* of one expert format; `layers/moe.py::FusedExperts` owns what every format
shares (expert parallelism, the loader bookkeeping, the dispatch between the grouped launches, the dense form
and the per-expert loop). Three schemes:
- `UnquantizedExperts` (bf16 / fp16 / fp32 weights): the grouped launches are torch._grouped_mm (CUTLASS on
  sm_90).
- `Fp8BlockExperts` (FP8_PB_WO: e4m3 weights, fp32 128x128 block scales, gate and up on their own grids):
  weights dequantized to the activation dtype, 16-bit matmuls.
- `NvFp4Experts` (NVFP4 / W4A16_NVFP4; MXFP4 checkpoints cast to NVFP4 as they load, exactly): the W4A16
  kernels of kernels/nvfp4_gemm (decode launches, the wgmma and tile GEMMs), the CPU int8 kernel, or the fp32
  reference.

Parameters are registered on the FusedExperts module under the checkpoint's names after vLLM's stacking:
`w13_*` holds w1 (gate) in rows [0, I) and w3 (up) in rows [I, 2I), `w2_*` the down projection.

NVFP4 scale semantics (vLLM's ModelOpt NVFP4 fused MoE and its SiTU activation, which k3run matches),
computed once by `nvfp4_moe_scales`:
    a13 = max over ALL experts of w13_input_scale,   a2 = max over ALL experts of w2_input_scale
    a1_gscale = 1/a13, a2_gscale = 1/a2                       (activation encode scales)
    g1_alphas[e] = w13_weight_scale_2[e, (gate, up)] * a13   (GEMM1 accumulator -> real value, per half)
    g2_alphas[e] = w2_weight_scale_2[e] * a2
    g1_scale_c[e] = g1_alphas[e, up] * a2_gscale  for SwiGLU (silu(g)*u is linear in u: fold up's dequant)
                  = a2_gscale                     for SiTU and non-gated activations (the up half is
                                                  dequantized before the nonlinearity, never folded)
The per-expert loop evaluates exactly the kernel's form: GEMM accumulators over block-scaled codes, times
these alphas. W4A16 mode (Hopper/Marlin) keeps activations 16-bit: a13 = a2 = 1 and no quantize-dequantize.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from k3run.formats import (
    Mxfp4Scales,
    dequantize_fp8_block,
    dequantize_nvfp4,
    mxfp4_codes_to_nvfp4,
    mxfp4_scales_to_nvfp4,
    nvfp4_qdq,
)
from k3run.kernels.moe_ops import PendingCombine, combine
from k3run.knobs import knobs
from k3run.quant.algo import QuantAlgo

if TYPE_CHECKING:
    from torch import nn

    from k3run.layers.moe import FusedExperts

NvFp4ActMode = Literal["w4a4", "w4a16"]


# ---------------------------------------------------------------------------------------------------------
# NVFP4 scale folding


@dataclass(frozen=True)
class NvFp4MoeScales:
    """The folded scales of an NVFP4 MoE layer (local experts), see the module docstring."""

    a13: torch.Tensor  # fp32 0-dim, decode scale of the GEMM1 input (1 in W4A16 mode)
    a2: torch.Tensor  # fp32 0-dim, decode scale of the GEMM2 input (1 in W4A16 mode)
    a1_gscale: torch.Tensor  # 1 / a13
    a2_gscale: torch.Tensor  # 1 / a2
    g1_alphas: torch.Tensor  # fp32 [E_local, 2]: column 0 gate, column 1 up
    g2_alphas: torch.Tensor  # fp32 [E_local]
    g1_scale_c: torch.Tensor  # fp32 [E_local]


def compute_g1_scale_c(activation: str, g1_alphas: torch.Tensor, a2_gscale: torch.Tensor) -> torch.Tensor:
    """The post-activation scalar of GEMM1 per expert [E].

    activation: "silu" (SwiGLU: the up half's dequant scale is folded here), "situ" or "non_gated" (the
    up half, if any, is dequantized before the nonlinearity, so only the GEMM2 input encode scale remains).
    """
    if activation == "silu":
        return (g1_alphas[:, 1] * a2_gscale).float()
    if activation in ("situ", "non_gated"):
        return a2_gscale.float().expand(g1_alphas.shape[0]).clone()
    raise ValueError(f"compute_g1_scale_c: unknown activation {activation!r}")


def nvfp4_moe_scales(
    w13_weight_scale_2: torch.Tensor,
    w2_weight_scale_2: torch.Tensor,
    w13_input_scale: torch.Tensor | None,
    w2_input_scale: torch.Tensor | None,
    activation: str,
    act_mode: NvFp4ActMode,
) -> NvFp4MoeScales:
    """Fold the checkpoint scales. weight_scale_2 are the LOCAL experts' ([E_l, 2] and [E_l]); the input
    scales are the GLOBAL per-expert tensors ([E, 2] and [E]) because a13/a2 are maxima over all experts,
    which every EP rank must agree on."""
    if act_mode == "w4a4":
        if w13_input_scale is None or w2_input_scale is None:
            raise ValueError("NVFP4 MoE in w4a4 mode needs w13_input_scale and w2_input_scale")
        a13 = w13_input_scale.float().max()
        a2 = w2_input_scale.float().max()
    elif act_mode == "w4a16":
        a13 = a2 = torch.ones((), dtype=torch.float32, device=w13_weight_scale_2.device)
    else:
        raise ValueError(f"NVFP4 MoE act_mode: expected 'w4a4' or 'w4a16', got {act_mode!r}")
    g1_alphas = w13_weight_scale_2.float() * a13
    g2_alphas = w2_weight_scale_2.float() * a2
    a2_gscale = 1.0 / a2
    return NvFp4MoeScales(
        a13=a13,
        a2=a2,
        a1_gscale=1.0 / a13,
        a2_gscale=a2_gscale,
        g1_alphas=g1_alphas,
        g2_alphas=g2_alphas,
        g1_scale_c=compute_g1_scale_c(activation, g1_alphas, a2_gscale),
    )


# ---------------------------------------------------------------------------------------------------------
# the scheme interface


@dataclass(frozen=True)
class ExpertParam:
    """One stacked parameter: [E_l, ...] for local ones, [E, ...] for `local=False` (global maxima)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    local: bool = True


ExpertsOut = torch.Tensor | PendingCombine  # a deferred top-k sum only where Finish.defer asks for one


@dataclass(frozen=True)
class Finish:
    """What the routed experts' fp32 sum becomes: rounded to out_dtype, plus add() (the shared experts'
    output, called as late as possible so a side-stream branch is joined just before the sum)."""

    out_dtype: torch.dtype = torch.float32
    add: Callable[[], torch.Tensor] | None = None
    defer: bool = False  # leave the sum to the consumer (a PendingCombine: the next norm runs it)

    def combine(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | PendingCombine:
        """y [T * A, D] per pick (x's dtype) -> the weighted sum over each token's picks, fp32, slot order
        (with `defer`, y and the weights as a PendingCombine)."""
        if self.defer:
            return PendingCombine(y, weights, self.out_dtype, self.add)
        return combine(y, weights, self.out_dtype, None if self.add is None else self.add())

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        out = out.to(self.out_dtype)
        return out if self.add is None else out + self.add()


FP32_SUM = Finish()


class ExpertScheme:
    """The numerics of one expert format. Methods take the FusedExperts module `ex` (its parameters, widths,
    EP range); the scheme keeps the state its processing produces."""

    algo: QuantAlgo

    def params(self, ex: FusedExperts) -> list[ExpertParam]:
        raise NotImplementedError

    def filled_by(self, name: str, kind: str) -> list[str]:
        """The parameters one checkpoint tensor for `name` fills (more than one for MXFP4 scales)."""
        return [name]

    def store(
        self, ex: FusedExperts, what: str, name: str, kind: str, param: nn.Parameter, loaded: torch.Tensor,
        row: int, which: str,
    ) -> None:  # fmt: skip
        """Check one expert projection's checkpoint tensor and copy it into its row of param."""
        store_tensor(ex, what, kind, param, loaded, row, which, float_cast=False)

    def after_load(self, ex: FusedExperts, what: str, kind: str, row: int, which: str) -> None:
        """Called once a tensor's parameters are marked filled."""

    def process_after_loading(self, ex: FusedExperts) -> None:
        """After every tensor is in (the loader checked completeness)."""

    def expert(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e on x [n, D] -> [n, D] in x's dtype: the operations every other path reproduces."""
        raise NotImplementedError

    def grouped_ok(self, ex: FusedExperts, x: torch.Tensor) -> bool:
        """Whether `grouped` takes x: launches over every pick at once, no host synchronisation."""
        return False

    def grouped(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish
    ) -> ExpertsOut:
        raise NotImplementedError

    def loop_sum(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """The per-expert loop's fp32 sum, bit for bit, in fewer calls, where the format has such a path."""
        return None

    def prepare_dense(self, ex: FusedExperts) -> None:
        """Before the dense form runs on a GPU (outside any capture): whatever its batched form needs."""

    def all_experts(self, ex: FusedExperts, x: torch.Tensor) -> torch.Tensor | None:
        """Every local expert on every row of x [T, D] at once -> [E_l, T, D] in x's dtype (batched matmuls,
        `expert`'s operations); None where the format does not batch."""
        return None

    def picked(self, ex: FusedExperts, xp: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        """Pick p's row xp [P, 1, D] through local expert e[p] (weights gathered on the device) -> [P, 1, D];
        None where the format does not gather."""
        return None

    def describe(self) -> str:
        return self.algo.value


def expert_scheme_for(
    algo: QuantAlgo, act_mode: NvFp4ActMode, hidden_size: int, intermediate_size: int, prefix: str
) -> ExpertScheme:
    """The scheme of a checkpoint's expert quant_algo."""
    if algo == QuantAlgo.NONE:
        return UnquantizedExperts()
    if algo == QuantAlgo.FP8_PB_WO:
        return Fp8BlockExperts()
    if algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4, QuantAlgo.MXFP4):
        return NvFp4Experts(algo, act_mode, hidden_size, intermediate_size, prefix)
    raise ValueError(f"{prefix}: unsupported expert quant_algo {algo.value}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scalar_scale(what: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise ValueError(f"{what}: expected a scalar, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{what}: expected a float scalar, got {t.dtype}")
    v = float(t.float().item())
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"{what}: expected a positive finite scale, got {v}")
    return v


def check_dtype(what: str, t: torch.Tensor, want: torch.dtype, allow_float_cast: bool) -> None:
    if t.dtype == want:
        return
    if allow_float_cast and t.is_floating_point() and t.dtype.itemsize > 1 and want.itemsize > 1:
        return
    raise ValueError(f"{what}: expected dtype {want}, got {t.dtype}")


def gemm2_output(ex: FusedExperts, picks: int, x: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM2's output [picks, D] in x's dtype: the grouped kernels never write the rows of other
    ranks' picks, so under expert parallelism it starts as zeros for the sum (uninitialised otherwise)."""
    new = torch.empty if ex.num_local == ex.num_experts else torch.zeros
    return new(picks, ex.hidden_size, dtype=x.dtype, device=x.device)


def store_tensor(
    ex: FusedExperts, what: str, kind: str, param: nn.Parameter, loaded: torch.Tensor, row: int, which: str,
    float_cast: bool,
) -> None:  # fmt: skip
    """The shared store: per-expert scalars (input_scale, weight_scale_2; w13 keeps (gate, up) columns) or a
    tensor of exactly its slot's shape (w1 rows [0, I) of w13, w3 rows [I, 2I))."""
    dst = param.data[row]
    i = ex.intermediate_size
    if kind in ("input_scale", "weight_scale_2"):
        val = scalar_scale(what, loaded)
        if which == "w2":
            dst.fill_(val)
        else:
            dst[0 if which == "w1" else 1] = val
        return
    if which != "w2":
        dst = dst[:i] if which == "w1" else dst[i:]
    if tuple(loaded.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(loaded.shape)}")
    check_dtype(what, loaded, param.dtype, allow_float_cast=float_cast)
    dst.copy_(loaded.to(param.dtype))


# ---------------------------------------------------------------------------------------------------------
# unquantized


class UnquantizedExperts(ExpertScheme):
    algo = QuantAlgo.NONE

    def params(self, ex: FusedExperts) -> list[ExpertParam]:
        el, d, i, dt = ex.num_local, ex.hidden_size, ex.intermediate_size, ex.params_dtype
        return [ExpertParam("w13_weight", (el, 2 * i, d), dt), ExpertParam("w2_weight", (el, d, i), dt)]

    def store(
        self, ex: FusedExperts, what: str, name: str, kind: str, param: nn.Parameter, loaded: torch.Tensor,
        row: int, which: str,
    ) -> None:  # fmt: skip
        store_tensor(ex, what, kind, param, loaded, row, which, float_cast=True)

    def expert(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        h = ex.activation(x @ ex.w13_weight[e].to(x.dtype).t())
        return h @ ex.w2_weight[e].to(x.dtype).t()

    def grouped_ok(self, ex: FusedExperts, x: torch.Tensor) -> bool:
        """torch._grouped_mm (CUTLASS on sm_90): bf16 weights and input on such a GPU, D and I multiples of 8
        (16-byte rows)."""
        return (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and ex.w13_weight.dtype == torch.bfloat16
            and ex.hidden_size % 8 == 0
            and ex.intermediate_size % 8 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
        )

    def grouped(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish
    ) -> ExpertsOut:
        return grouped_mm_experts(ex, x, ids, weights, finish)

    def all_experts(self, ex: FusedExperts, x: torch.Tensor) -> torch.Tensor | None:
        h = ex.activation(torch.matmul(x, ex.w13_weight.to(x.dtype).transpose(1, 2)))  # [E, T, 2I]
        return torch.matmul(h, ex.w2_weight.to(x.dtype).transpose(1, 2))

    def picked(self, ex: FusedExperts, xp: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        h = ex.activation(torch.matmul(xp, ex.w13_weight[e].to(xp.dtype).transpose(1, 2)))  # [P, 1, 2I]
        return torch.matmul(h, ex.w2_weight[e].to(xp.dtype).transpose(1, 2))


def grouped_mm_experts(
    ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish = FP32_SUM
) -> ExpertsOut:
    """16-bit experts as two grouped GEMMs over the picks sorted by expert (torch._grouped_mm; on CPU tensors
    torch's own loop, which the tests use): the same operations as `expert` per expert (GEMM1 out in x's
    dtype, the activation, GEMM2), no host synchronisation (counts and offsets stay on the device), then the
    fp32 sum over each token's picks in slot order. Picks of other ranks' experts sort last, past the last
    offset, and count zero."""
    from k3run.kernels.picks import sort_picks

    t, a = ids.shape
    e = ex.num_local
    bucket, order, counts = sort_picks(ids.reshape(-1) - ex.first, e)
    valid = bucket < e
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // a]
    w13 = ex.w13_weight.to(x.dtype).transpose(1, 2)  # [E, D, 2I] (a view for matching dtypes)
    w2 = ex.w2_weight.to(x.dtype).transpose(1, 2)  # [E, I, D]
    h = ex.activation(torch._grouped_mm(xs, w13, offs=offs))  # [P, I] in x's dtype
    ys = torch._grouped_mm(h, w2, offs=offs)  # [P, D]
    y = torch.zeros_like(ys).index_copy_(0, order, ys)  # back in pick order
    y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero


# ---------------------------------------------------------------------------------------------------------
# FP8_PB_WO


class Fp8BlockExperts(ExpertScheme):
    algo = QuantAlgo.FP8_PB_WO

    def params(self, ex: FusedExperts) -> list[ExpertParam]:
        el, d, i = ex.num_local, ex.hidden_size, ex.intermediate_size
        f8 = torch.float8_e4m3fn
        return [
            ExpertParam("w13_weight", (el, 2 * i, d), f8),
            # gate and up keep their own 128x128 grids: [E_l, 2, ceil(I/128), ceil(D/128)]
            ExpertParam("w13_weight_scale", (el, 2, _ceil_div(i, 128), _ceil_div(d, 128)), torch.float32),
            ExpertParam("w2_weight", (el, d, i), f8),
            ExpertParam("w2_weight_scale", (el, _ceil_div(d, 128), _ceil_div(i, 128)), torch.float32),
        ]

    def store(
        self, ex: FusedExperts, what: str, name: str, kind: str, param: nn.Parameter, loaded: torch.Tensor,
        row: int, which: str,
    ) -> None:  # fmt: skip
        if kind != "weight_scale":
            return store_tensor(ex, what, kind, param, loaded, row, which, float_cast=False)
        dst = param.data[row]
        if which != "w2":
            dst = dst[0 if which == "w1" else 1]
        if loaded.numel() != dst.numel():
            raise ValueError(
                f"{what}: expected a [{dst.shape[0]}, 1, {dst.shape[1]}, 1] block scale, "
                f"got shape {tuple(loaded.shape)}"
            )
        check_dtype(what, loaded, torch.float32, allow_float_cast=True)
        dst.copy_(loaded.reshape(dst.shape).float())

    def expert(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        i = ex.intermediate_size
        w13 = torch.cat(
            [
                dequantize_fp8_block(ex.w13_weight[e, :i], ex.w13_weight_scale[e, 0], x.dtype),
                dequantize_fp8_block(ex.w13_weight[e, i:], ex.w13_weight_scale[e, 1], x.dtype),
            ]
        )
        h = ex.activation(x @ w13.t())
        return h @ dequantize_fp8_block(ex.w2_weight[e], ex.w2_weight_scale[e], x.dtype).t()

    def grouped_ok(self, ex: FusedExperts, x: torch.Tensor) -> bool:
        """kernels/fp8_grouped.py: a 16-bit input on CUDA."""
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)

    def grouped(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish
    ) -> ExpertsOut:
        """GEMM1 over every pick (gate and up rows on their own scale grids, as `expert` dequantizes them),
        the activation in x's dtype, GEMM2, the fp32 sum over each token's picks: `expert`'s operations per
        pick, in three launches over the picks grouped by expert on the device (`expert_blocks`)."""
        from k3run.kernels.fp8_grouped import fp8_block_gemm_grouped
        from k3run.kernels.nvfp4_gemm.tile import expert_blocks

        t, a = ids.shape
        picks, i = t * a, ex.intermediate_size
        x = x.contiguous()
        grp = expert_blocks(_local_ids(ids, ex.first), ex.num_local, FP8_BLOCK_PICKS)
        # gate and up on their own scale grids (each restarts at its first row): one launch each
        gu = torch.empty(picks, 2 * i, dtype=x.dtype, device=x.device)
        s13 = ex.w13_weight_scale
        w13 = ex.w13_weight
        fp8_block_gemm_grouped(x, w13[:, :i], s13[:, 0], grp, picks=picks, x_div=a, out=gu[:, :i])
        fp8_block_gemm_grouped(x, w13[:, i:], s13[:, 1], grp, picks=picks, x_div=a, out=gu[:, i:])
        h = ex.activation(gu)  # [picks, I] in x's dtype
        y = gemm2_output(ex, picks, x)
        fp8_block_gemm_grouped(h, ex.w2_weight, ex.w2_weight_scale, grp, picks=picks, x_div=1, out=y)
        return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero


# ---------------------------------------------------------------------------------------------------------
# NVFP4


# picks (tokens x top-k) up to which the NVFP4 experts run as two grouped launches (decode); not yet tuned
GROUPED_MAX_PICKS = 128
# tokens up to which the grouped launches are expert-major (each picked expert read once per group of up to 16
# of its tokens: expert_groups + nvfp4_gemv_by_expert); above this the per-pick launches or the tile GEMMs.
# K3RUN_MOE_BY_EXPERT=0 turns the expert-major launch off (for comparisons).
BY_EXPERT_MAX_TOKENS = 128
# tokens from which the grouped experts run on the tile GEMMs (wgmma on sm_90, else the Triton tile GEMM);
# below, the decode launches
TILE_FROM_TOKENS = BY_EXPERT_MAX_TOKENS + 1
# below TILE_FROM_TOKENS, the wgmma GEMMs from this many picks per local expert on average (and 2+ tokens):
# H200, bench/bench_wgmma.py --moe 16,32,64,128 (bench/RESULTS.md): K3's experts (56 local, top-16)
# 1.57x / 1.77x faster than the expert-major launches at 64 / 128 tokens (18 / 37 picks an expert), 0.91x at
# 32 (9); Kimi Linear's (256, top-8, <= 4 picks an expert up to 128 tokens) 0.57-0.70x, so they stay there
TILES_FROM_PICKS_PER_EXPERT = 12
# CPU NVFP4 experts on the reference path (below the compiled / SIMD paths' size) keep their decoded fp32
# weights when all of a layer's local experts take at most this much (the same values, decoded once)
CPU_REFERENCE_CACHE_BYTES = 64 << 20
# the Triton tile GEMM's picks per block (its wgmma N; an expert's last block is padded to it). H200,
# bench/bench_tile.py, the two grouped launches at 256 / 1024 / 4096 tokens (K3 experts, 56 local; Kimi
# Linear's, 256): 64 was the fastest or within 3% of it at every size, from 8 to 1170 picks per expert (16:
# 1.5-6x slower; 128 needs 8 warps and was not faster)
MOE_TILE_BM = 64
# picks per block of the grouped FP8_PB_WO expert GEMMs (kernels/fp8_grouped.py; not yet tuned)
FP8_BLOCK_PICKS = 64
# the wgmma kernel's picks per block by the mean picks per local expert: (up to this mean, block) pairs, 128
# above. H200, bench/bench_wgmma.py --moe (K3 experts 56 local, Kimi Linear's 256): 32-pick blocks best at
# means 2-18, 64 at 32-128 (within 3% of 128 at 73), 128 from 293 (64 there: 1.25x slower)
WGMMA_BLOCK_PICKS = ((24, 32), (160, 64))


class NvFp4Experts(ExpertScheme):
    """NVFP4 experts (W4A16_NVFP4 and MXFP4 checkpoints run as W4A16 NVFP4).

    State after `process_after_loading`: `scales` (the folded NVFP4 scales); `kernels` (whether the W4A16
    kernels run: None decides there (w4a16, D and I multiples of 128; on CUDA always, on the CPU where the
    compiled loops beat the reference), True / False force it); `kernel_scales` (gs13 [E_l, 2I], gs2 [E_l, 1]:
    the alphas as per-row decode scales); on CUDA the weights repacked in place (`split128`, `tiled`); on the
    CPU with K3RUN_CPU_INT8=1 in cpu_simd's vnni16 layout (`cpu_int8`); `ref_stack` (every local expert's
    decoded fp32 w13 [E_l, 2I, D] and w2 [E_l, D, I], for the reference's batched forms)."""

    algo = QuantAlgo.NVFP4

    def __init__(
        self, checkpoint_algo: QuantAlgo, act_mode: NvFp4ActMode, hidden_size: int, intermediate_size: int,
        prefix: str,
    ) -> None:  # fmt: skip
        self.checkpoint_algo = checkpoint_algo
        widths = (("D (expert hidden)", hidden_size), ("I (expert intermediate)", intermediate_size))
        if checkpoint_algo == QuantAlgo.MXFP4:
            for name, k in widths:
                if k % 32:
                    raise ValueError(f"{prefix}: MXFP4 experts need {name} % 32 == 0, got {k}")
        for name, k in widths:
            if k % 16:
                raise ValueError(f"{prefix}: NVFP4 experts need {name} % 16 == 0, got {k}")
        # W4A16_NVFP4 checkpoints carry no input scales: same weights, activations always 16-bit; MXFP4 too
        self.has_input_scale = checkpoint_algo == QuantAlgo.NVFP4
        self.act_mode: NvFp4ActMode = act_mode if self.has_input_scale else "w4a16"
        self.scales: NvFp4MoeScales | None = None
        self.kernels: bool | None = None
        self.kernel_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ref_stack: tuple[torch.Tensor, torch.Tensor] | None = None
        self.split128 = False
        self.tiled = False
        self.cpu_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (gs13 [E, 2I], gs2 [E, D])
        # MXFP4: scales whose codes need a rewrite (formats/mxfp4.py) that arrived before their codes
        self._mx_pending: dict[tuple[int, str], Mxfp4Scales] = {}

    @property
    def mxfp4(self) -> bool:
        return self.checkpoint_algo == QuantAlgo.MXFP4

    def params(self, ex: FusedExperts) -> list[ExpertParam]:
        el, d, i = ex.num_local, ex.hidden_size, ex.intermediate_size
        out = [
            ExpertParam("w13_weight", (el, 2 * i, d // 2), torch.uint8),
            ExpertParam("w13_weight_scale", (el, 2 * i, d // 16), torch.float8_e4m3fn),
            ExpertParam("w13_weight_scale_2", (el, 2), torch.float32),
            ExpertParam("w2_weight", (el, d, i // 2), torch.uint8),
            ExpertParam("w2_weight_scale", (el, d, i // 16), torch.float8_e4m3fn),
            ExpertParam("w2_weight_scale_2", (el,), torch.float32),
        ]
        if self.has_input_scale:
            # global over all experts (not just this rank's): a13/a2 are maxima over every expert
            e = ex.num_experts
            out += [
                ExpertParam("w13_input_scale", (e, 2), torch.float32, local=False),
                ExpertParam("w2_input_scale", (e,), torch.float32, local=False),
            ]
        return out

    # loading (MXFP4: an E8M0 weight_scale gives the NVFP4 block scales and weight_scale_2; codes that the
    # cast must rewrite are rewritten once both have arrived, in either order)

    def filled_by(self, name: str, kind: str) -> list[str]:
        return [name, f"{name}_2"] if self.mxfp4 and kind == "weight_scale" else [name]

    def store(
        self, ex: FusedExperts, what: str, name: str, kind: str, param: nn.Parameter, loaded: torch.Tensor,
        row: int, which: str,
    ) -> None:  # fmt: skip
        if self.mxfp4 and kind == "weight_scale":
            code_name = "w2_weight" if which == "w2" else "w13_weight"
            self._store_mxfp4_scale(
                ex, what, row, which, loaded, codes_in=ex.has_filled(code_name, row, which)
            )
        else:
            store_tensor(ex, what, kind, param, loaded, row, which, float_cast=False)

    def after_load(self, ex: FusedExperts, what: str, kind: str, row: int, which: str) -> None:
        if self.mxfp4 and kind == "weight" and (row, which) in self._mx_pending:
            self._mxfp4_codes(ex, row, which, self._mx_pending.pop((row, which)), what)

    def _codes_of(self, ex: FusedExperts, row: int, which: str) -> torch.Tensor:
        """The packed NVFP4 codes [N, K/2] of one local expert projection (a view into the parameter)."""
        if which == "w2":
            return ex.w2_weight.data[row]
        i = ex.intermediate_size
        return ex.w13_weight.data[row, :i] if which == "w1" else ex.w13_weight.data[row, i:]

    def _store_mxfp4_scale(
        self, ex: FusedExperts, what: str, row: int, which: str, loaded: torch.Tensor, codes_in: bool
    ) -> None:
        """An E8M0 weight_scale [N, K/32] -> this projection's NVFP4 block scales and weight_scale_2."""
        if loaded.dtype == torch.float8_e8m0fnu:
            loaded = loaded.view(torch.uint8)
        check_dtype(what, loaded, torch.uint8, allow_float_cast=False)
        d, i = ex.hidden_size, ex.intermediate_size
        n, k = (d, i) if which == "w2" else (i, d)
        if tuple(loaded.shape) != (n, k // 32):
            raise ValueError(
                f"{what}: expected an E8M0 scale of shape {(n, k // 32)} (one per 32 of K={k}), got "
                f"{tuple(loaded.shape)}"
            )
        scales = mxfp4_scales_to_nvfp4(loaded)
        # the cast runs on the CPU, where the checkpoint tensor was read; copy_ moves it to the parameters
        if which == "w2":
            ex.w2_weight_scale.data[row].copy_(scales.weight_scale)
            ex.w2_weight_scale_2.data[row].copy_(scales.weight_scale_2)
        else:
            dst = ex.w13_weight_scale.data[row]
            (dst[:i] if which == "w1" else dst[i:]).copy_(scales.weight_scale)
            ex.w13_weight_scale_2.data[row, 0 if which == "w1" else 1].copy_(scales.weight_scale_2)
        if scales.codes_unchanged:
            return
        if codes_in:
            self._mxfp4_codes(ex, row, which, scales, what)
        else:
            self._mx_pending[(row, which)] = scales

    def _mxfp4_codes(self, ex: FusedExperts, row: int, which: str, scales: Mxfp4Scales, what: str) -> None:
        codes = self._codes_of(ex, row, which)  # on the parameters' device; the scales on the CPU
        codes.copy_(mxfp4_codes_to_nvfp4(codes.cpu(), scales, what))

    # processing

    def process_after_loading(self, ex: FusedExperts) -> None:
        if self._mx_pending:  # every code is loaded by now (the loader checked completeness)
            raise ValueError(f"{ex.prefix}: MXFP4 scales without their codes: {sorted(self._mx_pending)[:4]}")
        self.scales = nvfp4_moe_scales(
            ex.w13_weight_scale_2,
            ex.w2_weight_scale_2,
            getattr(ex, "w13_input_scale", None),
            getattr(ex, "w2_input_scale", None),
            ex.activation.kind,
            self.act_mode,
        )
        d, i = ex.hidden_size, ex.intermediate_size
        eligible = self.act_mode == "w4a16" and d % 128 == 0 and i % 128 == 0
        if self.kernels is not None:
            use = self.kernels
        elif ex.w13_weight.is_cuda:
            use = eligible
        else:  # CPU: the compiled loops (kernels/nvfp4_gemm/cpu.py) where they apply, else the reference
            from k3run.kernels import cpu_fused

            use = eligible and cpu_fused.applies(i, d)
        if use and not eligible:
            raise ValueError(
                f"{ex.prefix}: NVFP4 expert kernels need w4a16 mode and D, I multiples of 128, got "
                f"{self.act_mode}, D={d}, I={i}"
            )
        self.kernels = bool(use)
        if not use:
            if not ex.w13_weight.is_cuda and self.reference_bytes(ex) <= CPU_REFERENCE_CACHE_BYTES:
                self.cache_reference_weights(ex)  # small CPU experts: decode once, not at every call
            return
        s = self.scales
        # GEMM1 rows: gate scaled by a1 * g1_alpha_gate; up by a1 * g1_alpha_up for SiTU (its nonlinear up is
        # dequantized first) or by a1 * g1_scale_c for SiLU (up enters linearly, so g1_scale_c = g1_alphas *
        # a2_gscale folds in); GEMM2 by g2_alphas, times g1_scale_c (= a2_gscale) for SiTU.
        situ = ex.activation.kind == "situ"
        up = s.g1_alphas[:, 1] if situ else s.g1_scale_c
        gs13 = torch.cat(
            [(s.a1_gscale * s.g1_alphas[:, :1]).expand(-1, i), (s.a1_gscale * up[:, None]).expand(-1, i)], 1
        )
        gs2 = s.g2_alphas * (s.g1_scale_c if situ else 1.0)
        self.kernel_scales = (gs13.float().contiguous(), gs2.float().reshape(-1, 1).contiguous())
        if not ex.w13_weight.is_cuda and self.cpu_int8 is None:
            self._pack_cpu_int8(ex)
        if ex.w13_weight.is_cuda and not self.split128:
            self._pack_cuda(ex)

    def _pack_cpu_int8(self, ex: FusedExperts) -> None:
        from k3run.kernels import cpu_simd

        if not (cpu_simd.int8_activations_enabled() and cpu_simd.vnni_available()):
            return
        # 2I and D are multiples of 16 (of 128 here): the layout has the checkpoint's bytes, so repack in
        # place (experts are most of a model's bytes)
        for w, sc in ((ex.w13_weight, ex.w13_weight_scale), (ex.w2_weight, ex.w2_weight_scale)):
            for e in range(ex.num_local):
                v = cpu_simd.nvfp4_vnni_pack(w.data[e], sc.data[e], torch.ones(1))
                w.data[e].view(-1).copy_(v.weight.view(-1))
                sc.data[e].view(torch.uint8).view(-1).copy_(v.scale.view(-1))
        assert self.kernel_scales is not None
        gs13_k, gs2_k = self.kernel_scales
        self.cpu_int8 = (gs13_k, gs2_k.expand(-1, ex.hidden_size).contiguous())

    def _pack_cuda(self, ex: FusedExperts) -> None:
        from k3run.kernels.nvfp4_gemm import check_scale_bytes, default_cuda_layout

        # K is a multiple of 128 and N (2I or D) of 16, so the kernel layouts have the checkpoint layout's
        # shape: repack in place
        self.tiled = default_cuda_layout(ex.w13_weight.device) == "tiled128"
        if self.tiled:  # before anything is repacked: the tiled decoder needs finite scales >= 0
            check_scale_bytes(ex.w13_weight_scale.data, f"{ex.prefix}.w13_weight_scale")
            check_scale_bytes(ex.w2_weight_scale.data, f"{ex.prefix}.w2_weight_scale")
        for w, sc in ((ex.w13_weight, ex.w13_weight_scale), (ex.w2_weight, ex.w2_weight_scale)):
            for e in range(ex.num_local):
                packed, bits = self._kernel_layout(w.data[e], sc.data[e])
                w.data[e].copy_(packed)
                sc.data[e].view(torch.uint8).copy_(bits)
        self.split128 = True

    def _kernel_layout(self, codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One projection's checkpoint-layout codes [N, K/2] and e4m3 scales [N, K/16] in the layout the
        stacks hold (split128, tiled on top where `tiled`): (codes, scale bytes) of the same shapes."""
        from k3run.kernels.nvfp4_gemm import repack_split128, tile_split128

        packed, bits = repack_split128(codes, scale)
        if self.tiled:
            packed, bits = tile_split128(packed, bits)
        return packed, bits

    def append_expert(
        self, ex: FusedExperts, w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor], what: str,
    ) -> int:  # fmt: skip
        """Stack one more expert after the local ones, for the grouped launches only (KimiMoE's shared
        expert, `KimiMoE.fuse_shared`); returns its index in the stacks (ex.num_stacked before the call).
        w13 = (codes uint8 [2I, D/2], e4m3 scales [2I, D/16], fp32 decode scale per row [2I]: gate rows
        then up rows), w2 = (codes [D, I/2], scales [D, I/16], decode scale fp32 [1]), in the checkpoint
        layout, W4A16 (no activation scales). The per-row decode scales are what the kernel path's alphas
        become for the routed experts (`kernel_scales`); the codes go into the stacks' layout here."""
        if not self.kernels or self.kernel_scales is None or self.cpu_int8 is not None:
            raise ValueError(f"{what}: only NVFP4 experts on the W4A16 kernels take an appended expert")
        d, i = ex.hidden_size, ex.intermediate_size
        f8 = torch.float8_e4m3fn
        want = {
            "gate_up codes": ((2 * i, d // 2), torch.uint8), "gate_up scales": ((2 * i, d // 16), f8),
            "gate_up decode scales": ((2 * i,), torch.float32), "down codes": ((d, i // 2), torch.uint8),
            "down scales": ((d, i // 16), f8), "down decode scale": ((1,), torch.float32),
        }  # fmt: skip
        for (name, (shape, dtype)), t in zip(want.items(), (*w13, *w2), strict=True):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{what}: {name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        dev = ex.w13_weight.device
        parts = []
        for codes, scale in ((w13[0], w13[1]), (w2[0], w2[1])):
            codes, scale = codes.to(dev), scale.to(dev)
            if self.tiled:
                from k3run.kernels.nvfp4_gemm import check_scale_bytes

                check_scale_bytes(scale.view(torch.uint8), f"{what} block scales")
            if self.split128:
                codes, bits = self._kernel_layout(codes, scale)
                scale = bits.view(f8)
            parts.append((codes, scale))
        index = ex.num_stacked
        for (name, sname), (codes, scale) in zip(
            (("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale")), parts, strict=True
        ):
            for pname, t in ((name, codes), (sname, scale)):
                p = getattr(ex, pname)
                p.data = torch.cat([p.data, t[None]])
        gs13, gs2 = self.kernel_scales
        self.kernel_scales = (
            torch.cat([gs13, w13[2].to(gs13)[None]]).contiguous(),
            torch.cat([gs2, w2[2].to(gs2).reshape(1, 1)]).contiguous(),
        )
        ex.appended += 1
        return index

    def expert_tensors(
        self, ex: FusedExperts, e: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local expert e's (w13, w13 scale, w2, w2 scale) in the checkpoint layout, whatever the storage."""
        tensors = (ex.w13_weight[e], ex.w13_weight_scale[e], ex.w2_weight[e], ex.w2_weight_scale[e])
        if self.cpu_int8 is not None:
            from k3run.kernels.cpu_simd import nvfp4_vnni_unpack

            w13, s13, w2, s2 = (t[e] for t in self.int8_stacks(ex))
            return (
                *nvfp4_vnni_unpack(w13, s13, 2 * ex.intermediate_size),
                *nvfp4_vnni_unpack(w2, s2, ex.hidden_size),
            )
        if not self.split128:
            return tensors
        from k3run.kernels.nvfp4_gemm import unpack_split128, untile_split128

        w13, s13, w2, s2 = tensors[0], tensors[1].view(torch.uint8), tensors[2], tensors[3].view(torch.uint8)
        if self.tiled:
            w13, s13 = untile_split128(w13, s13, w13.shape[0])
            w2, s2 = untile_split128(w2, s2, w2.shape[0])
        w13, s13 = unpack_split128(w13, s13, ex.hidden_size)
        w2, s2 = unpack_split128(w2, s2, ex.intermediate_size)
        return w13, s13, w2, s2

    def int8_stacks(self, ex: FusedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts repacked by K3RUN_CPU_INT8=1 seen in cpu_simd's vnni16 layout (views): w13
        [E, 2I/16, D/16, 128], its scales [E, 2I/16, D/16, 16], w2 [E, D/16, I/16, 128], its scales
        [E, D/16, I/16, 16]."""
        el, d, i = ex.num_local, ex.hidden_size, ex.intermediate_size
        return (
            ex.w13_weight.view(el, i // 8, d // 16, 128),
            ex.w13_weight_scale.view(torch.uint8).view(el, i // 8, d // 16, 16),
            ex.w2_weight.view(el, d // 16, i // 16, 128),
            ex.w2_weight_scale.view(torch.uint8).view(el, d // 16, i // 16, 16),
        )

    # one expert

    def expert(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        s = self.scales
        if s is None:
            raise RuntimeError(f"{ex.prefix}: process_after_loading() was not called")
        if self.kernels:
            return self._expert_kernels(ex, e, x)
        w13, w2 = self._block_weights(ex, e)
        return self.reference(
            ex, x, w13, w2, s.g1_alphas[e, 0], s.g1_alphas[e, 1], s.g1_scale_c[e], s.g2_alphas[e]
        )

    def _expert_kernels(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        """W4A16 through kernels/nvfp4_gemm: the global scales and the alphas ride in per-row decode scales
        (see process_after_loading); gate / up leave GEMM1 rounded to x's dtype, h enters GEMM2 in it."""
        from k3run.kernels.nvfp4_gemm import NvFp4Weight, nvfp4_linear

        assert self.kernel_scales is not None
        if self.cpu_int8 is not None:
            return self._expert_int8(ex, e, x)
        gs13, gs2 = self.kernel_scales
        layout = ("tiled128" if self.tiled else "split128") if self.split128 else "checkpoint"
        d, i = ex.hidden_size, ex.intermediate_size
        w13 = NvFp4Weight(ex.w13_weight[e], ex.w13_weight_scale[e].view(torch.uint8), gs13[e], d, layout)
        w2 = NvFp4Weight(ex.w2_weight[e], ex.w2_weight_scale[e].view(torch.uint8), gs2[e], i, layout)
        return nvfp4_linear(ex.gated(nvfp4_linear(x, w13)).to(x.dtype), w2)

    def _expert_int8(self, ex: FusedExperts, e: int, x: torch.Tensor) -> torch.Tensor:
        """`_expert_kernels` on the CPU's int8-activation kernel (weights in place in its layout)."""
        from k3run.kernels.cpu_simd import Vnni16Weight, nvfp4_vnni_gemm

        assert self.cpu_int8 is not None
        gs13, gs2 = self.cpu_int8
        w13, s13, w2, s2 = (t[e] for t in self.int8_stacks(ex))
        gu = nvfp4_vnni_gemm(x, Vnni16Weight(w13, s13, gs13[e], 2 * ex.intermediate_size)).to(x.dtype)
        h = ex.gated(gu).to(x.dtype)
        return nvfp4_vnni_gemm(h, Vnni16Weight(w2, s2, gs2[e], ex.hidden_size)).to(x.dtype)

    def _block_weights(self, ex: FusedExperts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference expert e's codes times block scales, fp32 (w13 [2I, D], w2 [D, I]); the global scales
        live in the alphas, as in the kernel. From the cache `cache_reference_weights` fills, else decoded
        now (the decode validates its scales on the host: no CUDA-graph capture)."""
        if self.ref_stack is not None:
            return self.ref_stack[0][e], self.ref_stack[1][e]
        if ex.w13_weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{ex.prefix}: the NVFP4 reference experts decode their weights on the host side; call "
                "cache_reference_weights() before capturing a CUDA graph"
            )
        w13_codes, w13_scale, w2_codes, w2_scale = self.expert_tensors(ex, e)
        return dequantize_nvfp4(w13_codes, w13_scale, 1.0), dequantize_nvfp4(w2_codes, w2_scale, 1.0)

    def reference_bytes(self, ex: FusedExperts) -> int:
        """The bytes `cache_reference_weights` would keep: fp32 w13 and w2 of every local expert."""
        return 4 * ex.num_local * 3 * ex.hidden_size * ex.intermediate_size

    def cache_reference_weights(self, ex: FusedExperts) -> None:
        """Keep every local reference expert's decoded weights (fp32) so the dense path needs no host work:
        for CUDA graphs of models whose experts cannot take the kernels (D or I not multiples of 128). Costs
        8x the NVFP4 bytes of the local experts; the dense path allows at most DENSE_MAX_EXPERTS."""
        if self.kernels or self.ref_stack is not None:
            return
        decoded = [self._block_weights(ex, e) for e in range(ex.num_local)]
        self.ref_stack = (torch.stack([w13 for w13, _ in decoded]), torch.stack([w2 for _, w2 in decoded]))

    def reference(
        self, ex: FusedExperts, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, g1_gate: torch.Tensor,
        g1_up: torch.Tensor, g1_c: torch.Tensor, g2: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The NVFP4 expert in the kernel's form: GEMM accumulators over codes times block scales (w13
        [..., 2I, D], w2 [..., D, I] fp32), times the alphas. One expert (0-dim alphas; x [n, D] -> [n, D])
        or a stack of E (alphas [E, 1, 1]; -> [E, n, D]), in x's dtype."""
        s = self.scales
        assert s is not None
        i = ex.intermediate_size
        w4a4 = self.act_mode == "w4a4"
        xin = x.float() * s.a1_gscale
        if w4a4:
            xin = nvfp4_qdq(xin, 1.0)
        acc = torch.matmul(xin, w13.transpose(-1, -2))  # [..., n, 2I] fp32 GEMM1 accumulator
        gate = acc[..., :i] * g1_gate
        if ex.activation.kind == "silu":
            h = torch.nn.functional.silu(gate) * acc[..., i:] * g1_c
        else:
            up = acc[..., i:] * g1_up
            h = ex.activation.on_halves(gate, up).float() * g1_c
        # h is already in GEMM2's encoded input domain (times a2_gscale)
        h = nvfp4_qdq(h, 1.0) if w4a4 else h.to(x.dtype).float()
        return (torch.matmul(h, w2.transpose(-1, -2)) * g2).to(x.dtype)

    # the batched forms

    def _alphas(self) -> tuple[torch.Tensor, ...]:
        s = self.scales
        assert s is not None
        return (s.g1_alphas[:, 0], s.g1_alphas[:, 1], s.g1_scale_c, s.g2_alphas)  # [E_l] each

    def prepare_dense(self, ex: FusedExperts) -> None:
        self.cache_reference_weights(ex)  # the reference decodes on the host side: once, outside any capture

    def all_experts(self, ex: FusedExperts, x: torch.Tensor) -> torch.Tensor | None:
        if self.kernels or self.ref_stack is None:
            return None
        return self.reference(ex, x, *self.ref_stack, *(a[:, None, None] for a in self._alphas()))

    def picked(self, ex: FusedExperts, xp: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
        if self.kernels or self.ref_stack is None:
            return None
        w13, w2 = self.ref_stack[0][e], self.ref_stack[1][e]
        return self.reference(ex, xp, w13, w2, *(al[e][:, None, None] for al in self._alphas()))

    def loop_sum(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | None:
        """The CPU int8 kernel (experts repacked by K3RUN_CPU_INT8=1) in two grouped calls: the picks sorted
        by expert as the loop sorts them, GEMM1 over all of them, the activation on all of them at once,
        GEMM2, then the loop's index_add in the same order. Each pick's rows go through exactly the loop's
        operations (the kernel's per-row results do not depend on the rows beside them)."""
        if self.cpu_int8 is None or torch.compiler.is_compiling():
            return None
        from k3run.kernels.cpu_simd import moe_combine, nvfp4_vnni_grouped
        from k3run.kernels.picks import sort_picks

        gs13, gs2 = self.cpu_int8
        el, d, i = ex.num_local, ex.hidden_size, ex.intermediate_size
        w13, s13, w2, s2 = self.int8_stacks(ex)
        picks = ids.shape[1]
        _, order, counts = sort_picks((ids - ex.first).reshape(-1), el)  # misses last
        offsets = torch.zeros(el + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=offsets[1:])
        hit = order[: int(offsets[-1])]
        out = torch.zeros(x.shape[0], d, dtype=torch.float32)
        if hit.numel() == 0:
            return out
        tok, slot = hit // picks, hit % picks
        # each token's row rounded to int8 once, then gathered per pick (the loop's x[tok] rows, same bits)
        gu = nvfp4_vnni_grouped(x, w13, s13, gs13, offsets, 2 * i, rows=tok).to(x.dtype)
        y = nvfp4_vnni_grouped(ex.gated(gu).to(x.dtype), w2, s2, gs2, offsets, d)
        # y rounded to the activation dtype as the loop's expert output, times its weight in fp32, summed in
        # the loop's order
        moe_combine(out, y, tok, weights[tok, slot].float(), x.dtype)
        return out

    # the grouped launches

    def grouped_ok(self, ex: FusedExperts, x: torch.Tensor) -> bool:
        """The NVFP4 kernels on weights repacked to tiled128 (CUDA: the layout both the decode and the tile
        kernels read) and a 16-bit input."""
        return bool(self.kernels) and self.tiled and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)

    def grouped(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish
    ) -> ExpertsOut:
        """GEMM1, the activation and GEMM2 for every (token, slot) pick in two grouped launches; picks of
        other ranks' experts give zero rows. For 2..BY_EXPERT_MAX_TOKENS tokens the launches are expert-major
        (`expert_groups` + `nvfp4_gemv_by_expert`: one program group per picked expert over all its tokens;
        with K3RUN_MOE_STREAM the same work shared evenly by a fixed grid, `expert_stream`),
        up to GROUPED_MAX_PICKS picks otherwise one program group per pick (`nvfp4_gemv_grouped`; at equal
        split_k the two give the same bits); from TILE_FROM_TOKENS tokens (prefill), or on the wgmma kernel
        from TILES_FROM_PICKS_PER_EXPERT picks an expert, the tile GEMMs (`_tile_gemms`). No host
        synchronisation, so a decode step can be captured in a CUDA graph. Sum over a token's picks in slot
        order, fp32."""
        t, a = ids.shape
        if (
            t >= TILE_FROM_TOKENS
            or (t * a > GROUPED_MAX_PICKS and not _by_expert(t))
            or (t >= 2 and self._on_wgmma(x) and t * a >= TILES_FROM_PICKS_PER_EXPERT * ex.num_stacked)
        ):
            return self._tile_gemms(ex, x, ids, weights, finish)
        from k3run.kernels.nvfp4_gemm import one_wave_split, sm_count
        from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert, nvfp4_gemv_grouped
        from k3run.kernels.nvfp4_gemm.groups import expert_groups

        assert self.kernel_scales is not None
        gs13, gs2 = self.kernel_scales
        d, i = ex.hidden_size, ex.intermediate_size
        local = _local_ids(ids, ex.first)
        sms = sm_count(x.device.index or 0)
        w13, s13 = ex.w13_weight, ex.w13_weight_scale.view(torch.uint8)
        w2, s2 = ex.w2_weight, ex.w2_weight_scale.view(torch.uint8)
        x = x.contiguous()
        # up to K3RUN_MOE_ACT_IN_GEMM1 tokens GEMM1's epilogue applies the activation (h, not gate | up,
        # comes back)
        kind = ex.activation.kind
        act = None
        if t <= knobs().moe_act_in_gemm1 and kind in ("silu", "situ"):
            act = (kind, ex.activation.beta or 1.0, ex.activation.linear_beta)
        from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

        if _by_expert(t):  # each picked expert's weights read once for all the tokens that picked it
            bt = by_expert_tile(t, a, ex.num_experts)  # the picks spread over every rank's experts
            grp = expert_groups(local, ex.num_stacked, bt)
            split1, reg1 = expert_split(bt, 2 * i * grp.shape[0], d, sms)
            full = ex.num_local == ex.num_experts  # no expert parallelism: every pick is in a group
            # the CUDA decode GEMV (K3RUN_SM90_GEMV_EXPERTS) or the Gluon one, at the same splits
            by_exp: Callable[..., torch.Tensor] = nvfp4_gemv_by_expert
            if sm90.experts_take(x, i, bt, act):
                by_exp = sm90.nvfp4_sm90_gemv_by_expert
            elif knobs().moe_stream != "0":  # stream-K: R programs an SM share the launch's K tiles
                from k3run.kernels.nvfp4_gemm import expert_stream

                per_sm, slots = (int(v) for v in knobs().moe_stream.split("/"))
                programs = expert_stream.stream_programs(x.device, per_sm, bt)
                by_exp = functools.partial(nvfp4_gemv_by_expert, programs=programs, stages=slots)
            gu = by_exp(
                x, w13, s13, gs13, grp, picks=t * a, slot_div=a, rows=2 * i, split_k=split1, maxnreg=reg1,
                all_in_groups=full, act=act,
            )  # fmt: skip
            h = gu if act else ex.gated(gu)
            split2, reg2 = expert_split(bt, d * grp.shape[0], i, sms)
            # with K3RUN_MOE_GEMM2_EARLY, GEMM2 may read the table (written before GEMM1) before its PDL wait
            y = by_exp(
                h.to(x.dtype), w2, s2, gs2, grp, picks=t * a, slot_div=1, rows=d, split_k=split2,
                maxnreg=reg2, all_in_groups=full, early_table=knobs().moe_gemm2_early,
            )  # fmt: skip
        else:
            # every pick's rows count towards one wave
            grouped = nvfp4_gemv_grouped
            if sm90.experts_take(x, i, 8, act):
                grouped = sm90.nvfp4_sm90_gemv_grouped
            split1, reg1 = one_wave_split(1, 2 * i * t * a, d, sms)
            gu = grouped(x, w13, s13, gs13, local, rows=2 * i, split_k=split1, maxnreg=reg1, act=act)
            h = gu if act else ex.gated(gu)
            split2, reg2 = one_wave_split(1, d * t * a, i, sms)
            y = grouped(h.to(x.dtype), w2, s2, gs2, local, rows=d, split_k=split2, maxnreg=reg2,
                        early_ids=knobs().moe_gemm2_early)  # fmt: skip
        return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero

    @staticmethod
    def _on_wgmma(x: torch.Tensor) -> bool:
        """Whether the grouped GEMMs take the wgmma kernel for x: 16-bit activations on sm_90."""
        import k3run.kernels.nvfp4_gemm as ng

        return x.dtype in (torch.float16, torch.bfloat16) and ng._wgmma_ok(x.device)

    def _tile_gemms(
        self, ex: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: Finish
    ) -> ExpertsOut:
        """The grouped experts on the tensor cores: the picks grouped by expert into blocks on the device
        (`expert_blocks`), GEMM1 over every block with the activation in its epilogue (gate and up rows with
        their own decode scales, each rounded to x's dtype first as the decode path stores them), GEMM2, and
        the fp32 sum over each token's picks in slot order (as the decode launches). On sm_90 with 16-bit
        activations both GEMMs run on the wgmma kernel (`wgmma.nvfp4_wgmma_grouped`, blocks of
        `wgmma_block_picks`), elsewhere on the Triton tile GEMM (blocks of MOE_TILE_BM)."""
        import k3run.kernels.nvfp4_gemm as ng
        from k3run.kernels.nvfp4_gemm.tile import expert_blocks, nvfp4_tile_gemm_grouped

        t, a = ids.shape
        local = _local_ids(ids, ex.first)
        x = x.contiguous()
        if self._on_wgmma(x):
            from k3run.kernels.build_errors import BUILD_ERRORS, triton_build_failed
            from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_grouped

            grp = expert_blocks(local, ex.num_stacked, wgmma_block_picks(t * a, ex.num_stacked))
            try:
                return finish.combine(self._gemm_pair(ex, x, a, grp, nvfp4_wgmma_grouped), weights)
            except BUILD_ERRORS as e:  # a Triton that cannot build it: the tile GEMM
                if not triton_build_failed(e):
                    raise
                ng._disable_wgmma(e)
        grp = expert_blocks(local, ex.num_stacked, MOE_TILE_BM)
        y = self._gemm_pair(ex, x, a, grp, nvfp4_tile_gemm_grouped)
        return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero

    def _gemm_pair(
        self, ex: FusedExperts, x: torch.Tensor, a: int, grp: torch.Tensor, gemm: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """GEMM1 (activation in the epilogue) and GEMM2 over the block table grp with `gemm`
        (tile.nvfp4_tile_gemm_grouped or wgmma.nvfp4_wgmma_grouped): y [picks, D] in x's dtype."""
        assert self.kernel_scales is not None
        gs13, gs2 = self.kernel_scales
        picks = x.shape[0] * a
        d, i = ex.hidden_size, ex.intermediate_size
        s13, s2 = ex.w13_weight_scale.view(torch.uint8), ex.w2_weight_scale.view(torch.uint8)
        # GEMM1 with the activation in its epilogue: h [picks, I] (rows of picks in no block, another rank's
        # experts, are never written and never read)
        act = ex.activation
        h = gemm(
            x, ex.w13_weight, s13, gs13, grp, picks=picks, x_div=a, k=d,
            out=torch.empty(picks, i, dtype=x.dtype, device=x.device),
            activation=(act.kind, act.beta, act.linear_beta),
        )  # fmt: skip
        return gemm(h, ex.w2_weight, s2, gs2, grp, picks=picks, x_div=1, k=i, out=gemm2_output(ex, picks, x))

    def describe(self) -> str:
        out = f"{self.algo.value}, nvfp4 {self.act_mode}"
        return out + (" (checkpoint MXFP4, cast to NVFP4 at load)" if self.mxfp4 else "")


def _by_expert(tokens: int) -> bool:
    return 2 <= tokens <= BY_EXPERT_MAX_TOKENS and knobs().moe_by_expert


# expected picks per expert up to which the expert-major launches take the 8-token tile at any batch
# (most experts' picks then fit one 8-token group). H100, bench/bench_expert_gemv.py (bench/RESULTS.md), the
# 8-token tile against the 16-token one at split 1: Kimi Linear's experts (256, top-8) 1.09-1.11x faster at
# 16 and 32 tokens (0.5 and 1 pick an expert), K3-shaped (64 experts, top-16) 1.10-1.14x at 16 tokens (4)
TILE8_PICKS_PER_EXPERT = 4


def by_expert_tile(tokens: int, top_k: int = 1, experts: int = 1) -> int:
    """The expert-major launch's token tile for a decode batch of `tokens` routed top_k over `experts`
    experts (all ranks'): 8 up to 8 tokens or up to TILE8_PICKS_PER_EXPERT expected picks an expert, else 16;
    K3RUN_MOE_BY_EXPERT_TILE=8|16|32 forces one (for comparisons)."""
    forced = knobs().moe_by_expert_tile
    if forced is not None:
        return forced
    return 8 if tokens <= 8 or tokens * top_k <= TILE8_PICKS_PER_EXPERT * experts else 16


def expert_split(bt: int, rows: int, k: int, sms: int) -> tuple[int, int | None]:
    """(split_k, maxnreg) of an expert-major launch of `rows` weight rows (every group's) over K = k:
    K3RUN_MOE_EXPERT_SPLIT, or with 0 `one_wave_split`'s wave-filling rule. Split 1 by default. H100,
    bench/RESULTS.md: in bench/bench_expert_gemv.py split 1 was the fastest in every cell at Kimi Linear's
    and K3's expert shapes, 1.1-1.7x the rule's split on Kimi Linear's (more programs over few 128-wide
    chunks cost more in their reductions and pipeline fills than idle slots do); with it the full-depth Kimi
    Linear step is 11% faster at 8 tokens and 6% at 16 than with the rule. The one-token step's per-pick
    launches keep the rule: there split 1 makes the step 3% slower."""
    from k3run.kernels.nvfp4_gemm import one_wave_split

    split = knobs().moe_expert_split
    if split == 0:
        return one_wave_split(bt, rows, k, sms)
    return split, None


def _local_ids(ids: torch.Tensor, first: int) -> torch.Tensor:
    """The picks' local expert ids [T * A] in ids' dtype (outside [0, num_local): another rank's expert);
    the kernels read int32 or int64, so rank 0 needs no launch at all."""
    flat = ids.reshape(-1)
    return flat if first == 0 else flat - first


def wgmma_block_picks(picks: int, local_experts: int) -> int:
    """Picks per block of the grouped wgmma GEMMs (WGMMA_BLOCK_PICKS): fewer padded rows in an expert's last
    block against more reads of its weights per pick."""
    mean = picks / max(local_experts, 1)
    return next((bt for most, bt in WGMMA_BLOCK_PICKS if mean <= most), 128)
