"""Kimi MoE: fp32 sigmoid router, routed experts (bf16, FP8_PB_WO or NVFP4; MXFP4 checkpoints cast to NVFP4 as
they load), shared experts, K3 latent MoE.

Expert weights are stored per rank as stacked tensors, named as vLLM names them after loading:
`w13_*` holds w1 (gate) in rows [0, I) and w3 (up) in rows [I, 2I) (gate first), `w2_*` the down projection.
Expert parallelism: rank r of ep holds the experts [r*E/ep, (r+1)*E/ep); its output is the partial sum over
its experts and the caller all-reduces it.

NVFP4 scale semantics (shared/spec/modelopt-contracts.md §4-5), computed once by `nvfp4_moe_scales`:
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

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from k3run.distributed import TPInfo, all_reduce
from k3run.formats import (
    Mxfp4Scales,
    dequantize_fp8_block,
    dequantize_nvfp4,
    mxfp4_codes_to_nvfp4,
    mxfp4_scales_to_nvfp4,
    nvfp4_qdq,
)
from k3run.kernels.moe_ops import combine, gated, route_sigmoid_topk, router_logits_ref, sigmoid_topk
from k3run.layers.activation import GatedActivation
from k3run.layers.branch import Branch
from k3run.layers.norm import norm_weight_loader
from k3run.loader import SliceLoader, TensorSource
from k3run.quant.algo import QuantAlgo

NvFp4ActMode = Literal["w4a4", "w4a16"]
_SHARDS = ("w1", "w2", "w3")


def _group_limited(num_expert_group: int, topk_group: int) -> bool:
    """Whether routing keeps only the best topk_group of num_expert_group expert groups."""
    return num_expert_group > 1 and topk_group < num_expert_group


def route(
    logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing: logits fp32 [T, E] -> (weights fp32 [T, A], expert ids int64 [T, A]).

    The correction bias only decides WHICH experts are picked; the weights are the unbiased scores, then
    renormalised over the picked experts and multiplied by routed_scaling_factor.
    """
    if logits.dtype != torch.float32:
        raise ValueError(f"route: logits must be fp32, got {logits.dtype}")
    if not _group_limited(num_expert_group, topk_group):  # one kernel on CUDA
        return sigmoid_topk(logits, e_score_correction_bias, top_k, renormalize, routed_scaling_factor)
    t, e = logits.shape
    scores = torch.sigmoid(logits)
    choice = scores + e_score_correction_bias.float()
    # DeepSeek group limiting: a group's score is the sum of its two best (biased) experts.
    grouped = choice.view(t, num_expert_group, e // num_expert_group)
    group_scores = grouped.topk(min(2, e // num_expert_group), dim=-1).values.sum(-1)  # [T, G]
    keep = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    choice = choice.masked_fill(~group_mask.repeat_interleave(e // num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    num_expert_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0


class MoERouter(nn.Module):
    """`gate.weight` [E, D] and `gate.e_score_correction_bias` [E], both kept in fp32 (replicated)."""

    def __init__(self, num_experts: int, hidden_size: int, cfg: RouterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        for p in (self.weight, self.e_score_correction_bias):
            p.weight_loader = norm_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        if not _group_limited(c.num_expert_group, c.topk_group):  # two launches on CUDA
            return route_sigmoid_topk(
                x, self.weight, self.e_score_correction_bias, c.top_k, c.renormalize, c.routed_scaling_factor
            )
        logits = router_logits_ref(x, self.weight)  # [T, E] fp32
        return route(
            logits,
            self.e_score_correction_bias,
            c.top_k,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            renormalize=c.renormalize,
            routed_scaling_factor=c.routed_scaling_factor,
        )


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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# picks (tokens x top-k) up to which the NVFP4 experts run as two grouped launches (decode); not yet tuned
GROUPED_MAX_PICKS = 128
# tokens up to which the grouped launches are expert-major (each picked expert read once per group of up to 16
# of its tokens: expert_groups + nvfp4_gemv_by_expert); above this the per-expert loop runs (prefill sizes).
# K3RUN_MOE_BY_EXPERT=0 turns the expert-major launch off (for comparisons).
BY_EXPERT_MAX_TOKENS = 128
# the expert-major token tile: 8 up to 8 tokens, 16 up to BY_EXPERT_T32_FROM - 1, then 32 (an expert picked c
# times runs ceil(c / tile) tiles). K3RUN_MOE_BY_EXPERT_TILE=8|16|32 forces one (for comparisons).
BY_EXPERT_T32_FROM = 1 << 30
# tokens from which the grouped experts run on the tile GEMM (tile.nvfp4_tile_gemm_grouped: tensor cores,
# blocks of up to MOE_TILE_BM picks per expert); below, the decode launches
TILE_FROM_TOKENS = BY_EXPERT_MAX_TOKENS + 1
# CPU NVFP4 experts on the reference path (below the compiled / SIMD paths' size) keep their decoded fp32
# weights when all of a layer's local experts take at most this much (the same values, decoded once)
CPU_REFERENCE_CACHE_BYTES = 64 << 20


class FusedExperts(nn.Module):
    """E/ep routed experts of width hidden -> intermediate -> hidden with a gated activation.

    `forward(x [T, D], ids [T, A], weights fp32 [T, A]) -> fp32 [T, D]`: sum over the top-k picks that land on
    this rank's experts of weight * expert(x) (fp32 accumulation, each expert output rounded to x's dtype
    first, as the reference combine does). Checkpoint tensors arrive through `weight_loader(param, tensor,
    (global_expert_id, "w1" | "w2" | "w3"))`.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: GatedActivation,
        algo: QuantAlgo,
        *,
        ep: TPInfo,
        params_dtype: torch.dtype,
        nvfp4_act_mode: NvFp4ActMode = "w4a16",
        prefix: str = "experts",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_local = ep.shard(num_experts, f"{prefix}: num_experts")
        self.first = ep.rank * self.num_local
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.prefix = prefix
        self.params_dtype = params_dtype
        # W4A16_NVFP4 checkpoints carry no input scales: same weights, activations always 16-bit. MXFP4
        # experts (compressed-tensors weight_packed + E8M0 weight_scale) are cast to NVFP4 as they load
        # (exact, formats/mxfp4.py) and then run as W4A16 NVFP4 experts
        has_input_scale = algo == QuantAlgo.NVFP4
        self.checkpoint_algo = algo
        if algo == QuantAlgo.MXFP4:
            for name, k in (
                ("D (expert hidden)", hidden_size),
                ("I (expert intermediate)", intermediate_size),
            ):
                if k % 32:
                    raise ValueError(f"{prefix}: MXFP4 experts need {name} % 32 == 0, got {k}")
        if algo in (QuantAlgo.W4A16_NVFP4, QuantAlgo.MXFP4):
            algo, nvfp4_act_mode = QuantAlgo.NVFP4, "w4a16"
        self.algo = algo
        # MXFP4: scales whose codes need a rewrite (formats/mxfp4.py) that arrived before their codes
        self._mx_pending: dict[tuple[int, str], Mxfp4Scales] = {}
        self.nvfp4_act_mode: NvFp4ActMode = nvfp4_act_mode
        self.scales: NvFp4MoeScales | None = None
        # NVFP4 experts through the W4A16 linear kernels (kernels/nvfp4_gemm): None = decide at
        # process_after_loading (w4a16, D and I multiples of 128; on CUDA always, on the CPU for experts of
        # at least cpu_fused.MIN_WEIGHTS weights, where the compiled CPU loops beat the reference); True/False
        # force it (tests)
        self.nvfp4_kernels: bool | None = None
        self._kernel_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # gs13 [E_l, 2I], gs2 [E_l, 1]
        # cache_reference_weights: every local reference expert's decoded w13 [E_l, 2I, D], w2 [E_l, D, I]
        self._ref_stack: tuple[torch.Tensor, torch.Tensor] | None = None
        self._split128 = False  # expert weights repacked in place to the kernel layout (CUDA)
        self._tiled = False  # ... and that layout is tiled128 (where the cp.async decode kernel runs)
        # CPU, K3RUN_CPU_INT8=1: expert weights repacked in place to cpu_simd's vnni16 layout
        self._cpu_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (gs13 [E, 2I], gs2 [E, D])
        self._filled: set[tuple[str, int, str]] = set()
        self._expected: list[tuple[str, int, str]] = []
        el, d, i = self.num_local, hidden_size, intermediate_size
        if algo == QuantAlgo.NONE:
            self._add("w13_weight", (el, 2 * i, d), params_dtype)
            self._add("w2_weight", (el, d, i), params_dtype)
        elif algo == QuantAlgo.FP8_PB_WO:
            self._add("w13_weight", (el, 2 * i, d), torch.float8_e4m3fn)
            # gate and up keep their own 128x128 grids: [E_l, 2, ceil(I/128), ceil(D/128)]
            self._add("w13_weight_scale", (el, 2, _ceil_div(i, 128), _ceil_div(d, 128)), torch.float32)
            self._add("w2_weight", (el, d, i), torch.float8_e4m3fn)
            self._add("w2_weight_scale", (el, _ceil_div(d, 128), _ceil_div(i, 128)), torch.float32)
        elif algo == QuantAlgo.NVFP4:
            for name, k in (("D (expert hidden)", d), ("I (expert intermediate)", i)):
                if k % 16:
                    raise ValueError(f"{prefix}: NVFP4 experts need {name} % 16 == 0, got {k}")
            self._add("w13_weight", (el, 2 * i, d // 2), torch.uint8)
            self._add("w13_weight_scale", (el, 2 * i, d // 16), torch.float8_e4m3fn)
            self._add("w13_weight_scale_2", (el, 2), torch.float32)
            self._add("w2_weight", (el, d, i // 2), torch.uint8)
            self._add("w2_weight_scale", (el, d, i // 16), torch.float8_e4m3fn)
            self._add("w2_weight_scale_2", (el,), torch.float32)
            if has_input_scale:
                # global over all experts (not just this rank's): a13/a2 are maxima over every expert
                self._add("w13_input_scale", (num_experts, 2), torch.float32, local=False)
                self._add("w2_input_scale", (num_experts,), torch.float32, local=False)
        else:
            raise ValueError(f"{prefix}: unsupported expert quant_algo {algo.value}")

    def _add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, local: bool = True) -> None:
        if dtype.is_floating_point and dtype.itemsize > 1:
            data = torch.full(shape, float("nan"), dtype=dtype)
        else:
            data = torch.zeros(shape, dtype=dtype)
        p = nn.Parameter(data, requires_grad=False)
        kind = name.split("_", 1)[1]  # weight, weight_scale, weight_scale_2, input_scale

        def load(param: nn.Parameter, loaded: TensorSource, shard_id: object) -> None:
            self._load(name, kind, local, param, loaded, shard_id)

        p.weight_loader = SliceLoader(load)  # type: ignore[attr-defined]
        self.register_parameter(name, p)
        experts = range(self.first, self.first + self.num_local) if local else range(self.num_experts)
        shards = ("w2",) if name.startswith("w2_") else ("w1", "w3")
        self._expected += [(name, e, w) for e in experts for w in shards]

    def grouped_ok(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether fused_experts takes the grouped launches (`_fused_experts_grouped`, any token count): NVFP4
        experts repacked to tiled128 (CUDA, the layout both the decode and the tile kernels read) and a
        16-bit input."""
        return (
            self.algo == QuantAlgo.NVFP4
            and bool(self.nvfp4_kernels)
            and self._tiled
            and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
        )

    def grouped_mm_ok(self, x: torch.Tensor) -> bool:
        """Whether fused_experts runs 16-bit (unquantized) experts as two grouped GEMMs
        (`_fused_experts_grouped_mm`: torch._grouped_mm, CUTLASS on sm_90): bf16 weights and input on such a
        GPU, D and I multiples of 8 (16-byte rows)."""
        return (
            self.algo == QuantAlgo.NONE
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and self.w13_weight.dtype == torch.bfloat16
            and self.hidden_size % 8 == 0
            and self.intermediate_size % 8 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
        )

    def is_local(self, expert_id: int) -> bool:
        return self.first <= expert_id < self.first + self.num_local

    def unfilled_parameters(self) -> list[str]:
        """(parameter, expert, shard) triples no checkpoint tensor has filled yet."""
        return [f"{n} (expert {e} {w})" for n, e, w in self._expected if (n, e, w) not in self._filled]

    @property
    def mxfp4(self) -> bool:
        """Whether the checkpoint stores these experts as MXFP4 (compressed-tensors), cast at load."""
        return self.checkpoint_algo == QuantAlgo.MXFP4

    def _load(
        self, name: str, kind: str, local: bool, param: nn.Parameter, source: TensorSource, shard_id: object
    ) -> None:
        # (expert_id, 'w1'|'w2'|'w3'), or with a third item "packed" for a compressed-tensors weight_packed
        if (
            not isinstance(shard_id, tuple)
            or len(shard_id) not in (2, 3)
            or not isinstance(shard_id[0], int)
            or shard_id[1] not in _SHARDS
            or shard_id[2:] not in ((), ("packed",))
        ):
            raise ValueError(
                f"{self.prefix}.{name}: shard_id must be (expert_id, 'w1'|'w2'|'w3'[, 'packed']), got "
                f"{shard_id}"
            )
        eid, which = shard_id[:2]
        what = f"{self.prefix}.{eid}.{which} -> {name}"
        if not 0 <= eid < self.num_experts:
            raise ValueError(f"{what}: expert id {eid} out of range [0, {self.num_experts})")
        if (which == "w2") != name.startswith("w2_"):
            raise ValueError(f"{what}: shard {which} does not belong to {name}")
        packed = shard_id[2:] == ("packed",)
        if packed != (self.mxfp4 and kind == "weight"):
            raise ValueError(
                f"{what}: MXFP4 (compressed-tensors) experts store codes as weight_packed, got a .weight"
                if self.mxfp4
                else f"{what}: a compressed-tensors weight_packed tensor, but these experts are "
                f"{self.checkpoint_algo.value} (the quantization config does not make them MXFP4)"
            )
        if local and not self.is_local(eid):
            return  # another EP rank holds this expert: never read its bytes
        filled = [(name, eid, which)]
        if self.mxfp4 and kind == "weight_scale":  # the E8M0 scale gives the NVFP4 weight_scale_2 too
            filled.append((f"{name}_2", eid, which))
        if any(f in self._filled for f in filled):
            raise ValueError(f"{what}: loaded twice")
        row = eid - self.first if local else eid
        if self.mxfp4 and kind == "weight_scale":
            self._store_mxfp4_scale(what, eid, row, which, source.read())
        else:
            self._store(what, kind, param, source.read(), row, which)
        self._filled.update(filled)
        if self.mxfp4 and kind == "weight" and (row, which) in self._mx_pending:
            self._mxfp4_codes(what, row, which, self._mx_pending.pop((row, which)))

    def _codes_of(self, row: int, which: str) -> torch.Tensor:
        """The packed NVFP4 codes [N, K/2] of one local expert projection (a view into the parameter)."""
        if which == "w2":
            return self.w2_weight.data[row]
        i = self.intermediate_size
        return self.w13_weight.data[row, :i] if which == "w1" else self.w13_weight.data[row, i:]

    def _store_mxfp4_scale(self, what: str, eid: int, row: int, which: str, loaded: torch.Tensor) -> None:
        """An E8M0 weight_scale [N, K/32] -> this projection's NVFP4 block scales and weight_scale_2."""
        if loaded.dtype == torch.float8_e8m0fnu:
            loaded = loaded.view(torch.uint8)
        _check_dtype(what, loaded, torch.uint8, allow_float_cast=False)
        n, k = (
            (self.hidden_size, self.intermediate_size)
            if which == "w2"
            else (self.intermediate_size, self.hidden_size)
        )
        if tuple(loaded.shape) != (n, k // 32):
            raise ValueError(
                f"{what}: expected an E8M0 scale of shape {(n, k // 32)} (one per 32 of K={k}), got "
                f"{tuple(loaded.shape)}"
            )
        scales = mxfp4_scales_to_nvfp4(loaded)
        # the cast runs on the CPU, where the checkpoint tensor was read; copy_ moves it to the parameters
        if which == "w2":
            self.w2_weight_scale.data[row].copy_(scales.weight_scale)
            self.w2_weight_scale_2.data[row].copy_(scales.weight_scale_2)
        else:
            i = self.intermediate_size
            dst = self.w13_weight_scale.data[row]
            (dst[:i] if which == "w1" else dst[i:]).copy_(scales.weight_scale)
            self.w13_weight_scale_2.data[row, 0 if which == "w1" else 1].copy_(scales.weight_scale_2)
        if scales.codes_unchanged:
            return
        name = "w2_weight" if which == "w2" else "w13_weight"
        if (name, eid, which) in self._filled:
            self._mxfp4_codes(what, row, which, scales)
        else:
            self._mx_pending[(row, which)] = scales

    def _mxfp4_codes(self, what: str, row: int, which: str, scales: Mxfp4Scales) -> None:
        codes = self._codes_of(row, which)  # on the parameters' device; the scales on the CPU
        codes.copy_(mxfp4_codes_to_nvfp4(codes.cpu(), scales, what))

    def _store(
        self, what: str, kind: str, param: nn.Parameter, loaded: torch.Tensor, row: int, which: str
    ) -> None:
        dst = param.data[row]
        i = self.intermediate_size
        if kind in ("input_scale", "weight_scale_2"):  # per-expert scalars; w13 keeps (gate, up) columns
            val = _scalar(what, loaded)
            if which == "w2":
                dst.fill_(val)
            else:
                dst[0 if which == "w1" else 1] = val
            return
        if self.algo == QuantAlgo.FP8_PB_WO and kind == "weight_scale":
            if which != "w2":
                dst = dst[0 if which == "w1" else 1]
            if loaded.numel() != dst.numel():
                raise ValueError(
                    f"{what}: expected a [{dst.shape[0]}, 1, {dst.shape[1]}, 1] block scale, "
                    f"got shape {tuple(loaded.shape)}"
                )
            _check_dtype(what, loaded, torch.float32, allow_float_cast=True)
            dst.copy_(loaded.reshape(dst.shape).float())
            return
        if which != "w2":
            dst = dst[:i] if which == "w1" else dst[i:]
        if tuple(loaded.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(loaded.shape)}")
        _check_dtype(what, loaded, param.dtype, allow_float_cast=self.algo == QuantAlgo.NONE)
        dst.copy_(loaded.to(param.dtype))

    def process_after_loading(self) -> None:
        if self._mx_pending:  # every code is loaded by now (the loader checked completeness)
            raise ValueError(
                f"{self.prefix}: MXFP4 scales without their codes: {sorted(self._mx_pending)[:4]}"
            )
        if self.algo != QuantAlgo.NVFP4:
            return
        self.scales = nvfp4_moe_scales(
            self.w13_weight_scale_2,
            self.w2_weight_scale_2,
            getattr(self, "w13_input_scale", None),
            getattr(self, "w2_input_scale", None),
            self.activation.kind,
            self.nvfp4_act_mode,
        )
        eligible = (
            self.nvfp4_act_mode == "w4a16"
            and self.hidden_size % 128 == 0
            and self.intermediate_size % 128 == 0
        )
        if self.nvfp4_kernels is not None:
            use = self.nvfp4_kernels
        elif self.w13_weight.is_cuda:
            use = eligible
        else:  # CPU: the compiled loops (kernels/nvfp4_gemm/cpu.py) where they apply, else the reference
            from k3run.kernels import cpu_fused

            use = eligible and cpu_fused.applies(self.intermediate_size, self.hidden_size)
        if use and not eligible:
            raise ValueError(
                f"{self.prefix}: NVFP4 expert kernels need w4a16 mode and D, I multiples of 128, got "
                f"{self.nvfp4_act_mode}, D={self.hidden_size}, I={self.intermediate_size}"
            )
        self.nvfp4_kernels = bool(use)
        if not use:
            if not self.w13_weight.is_cuda and self._reference_bytes() <= CPU_REFERENCE_CACHE_BYTES:
                self.cache_reference_weights()  # small CPU experts: decode once, not at every call
            return
        s, i = self.scales, self.intermediate_size
        # GEMM1 rows: gate scaled by a1 * g1_alpha_gate; up by a1 * g1_alpha_up for SiTU (its nonlinear up is
        # dequantized first) or by a1 * g1_scale_c for SiLU (up enters linearly, so g1_scale_c = g1_alphas *
        # a2_gscale folds in); GEMM2 by g2_alphas, times g1_scale_c (= a2_gscale) for SiTU.
        up = s.g1_alphas[:, 1] if self.activation.kind == "situ" else s.g1_scale_c
        gs13 = torch.cat(
            [(s.a1_gscale * s.g1_alphas[:, :1]).expand(-1, i), (s.a1_gscale * up[:, None]).expand(-1, i)], 1
        )
        gs2 = s.g2_alphas * (s.g1_scale_c if self.activation.kind == "situ" else 1.0)
        self._kernel_scales = (gs13.float().contiguous(), gs2.float().reshape(-1, 1).contiguous())
        if not self.w13_weight.is_cuda and self._cpu_int8 is None:
            from k3run.kernels import cpu_simd

            if cpu_simd.int8_activations_enabled() and cpu_simd.vnni_available():
                # 2I and D are multiples of 16 (of 128 here): the layout has the checkpoint's bytes, so
                # repack in place (experts are most of a model's bytes)
                for w, sc in (
                    (self.w13_weight, self.w13_weight_scale),
                    (self.w2_weight, self.w2_weight_scale),
                ):
                    for e in range(self.num_local):
                        v = cpu_simd.nvfp4_vnni_pack(w.data[e], sc.data[e], torch.ones(1))
                        w.data[e].view(-1).copy_(v.weight.view(-1))
                        sc.data[e].view(torch.uint8).view(-1).copy_(v.scale.view(-1))
                gs13_k, gs2_k = self._kernel_scales
                self._cpu_int8 = (gs13_k, gs2_k.expand(-1, self.hidden_size).contiguous())
        if self.w13_weight.is_cuda and not self._split128:
            from k3run.kernels.nvfp4_gemm import (
                check_scale_bytes,
                default_cuda_layout,
                repack_split128,
                tile_split128,
            )

            # K is a multiple of 128 and N (2I or D) of 16, so the kernel layouts have the checkpoint layout's
            # shape: repack in place
            self._tiled = default_cuda_layout(self.w13_weight.device) == "tiled128"
            if self._tiled:  # before anything is repacked: the tiled decoder needs finite scales >= 0
                check_scale_bytes(self.w13_weight_scale.data, f"{self.prefix}.w13_weight_scale")
                check_scale_bytes(self.w2_weight_scale.data, f"{self.prefix}.w2_weight_scale")
            for w, sc in ((self.w13_weight, self.w13_weight_scale), (self.w2_weight, self.w2_weight_scale)):
                for e in range(self.num_local):
                    packed, bits = repack_split128(w.data[e], sc.data[e])
                    if self._tiled:
                        packed, bits = tile_split128(packed, bits)
                    w.data[e].copy_(packed)
                    sc.data[e].view(torch.uint8).copy_(bits)
            self._split128 = True

    def nvfp4_expert_tensors(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local expert e's (w13, w13 scale, w2, w2 scale) in the checkpoint layout, whatever the storage."""
        tensors = (self.w13_weight[e], self.w13_weight_scale[e], self.w2_weight[e], self.w2_weight_scale[e])
        if self._cpu_int8 is not None:
            from k3run.kernels.cpu_simd import nvfp4_vnni_unpack

            w13, s13, w2, s2 = (t[e] for t in self.int8_stacks())
            return (
                *nvfp4_vnni_unpack(w13, s13, 2 * self.intermediate_size),
                *nvfp4_vnni_unpack(w2, s2, self.hidden_size),
            )
        if not self._split128:
            return tensors
        from k3run.kernels.nvfp4_gemm import unpack_split128, untile_split128

        w13, s13, w2, s2 = tensors[0], tensors[1].view(torch.uint8), tensors[2], tensors[3].view(torch.uint8)
        if self._tiled:
            w13, s13 = untile_split128(w13, s13, w13.shape[0])
            w2, s2 = untile_split128(w2, s2, w2.shape[0])
        w13, s13 = unpack_split128(w13, s13, self.hidden_size)
        w2, s2 = unpack_split128(w2, s2, self.intermediate_size)
        return w13, s13, w2, s2

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out_dtype: torch.dtype = torch.float32,
        add: Callable[[], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"{self.prefix}: expected x [T, {self.hidden_size}], got {tuple(x.shape)}")
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"{self.prefix}: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T, A]"
            )
        return fused_experts(self, x, ids, weights, out_dtype=out_dtype, add=add)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One local expert e on x [n, D] -> [n, D] in x's dtype."""
        i = self.intermediate_size
        if self.algo == QuantAlgo.NONE:
            h = self.activation(x @ self.w13_weight[e].to(x.dtype).t())
            return h @ self.w2_weight[e].to(x.dtype).t()
        if self.algo == QuantAlgo.FP8_PB_WO:
            w13 = torch.cat(
                [
                    dequantize_fp8_block(self.w13_weight[e, :i], self.w13_weight_scale[e, 0], x.dtype),
                    dequantize_fp8_block(self.w13_weight[e, i:], self.w13_weight_scale[e, 1], x.dtype),
                ]
            )
            h = self.activation(x @ w13.t())
            return h @ dequantize_fp8_block(self.w2_weight[e], self.w2_weight_scale[e], x.dtype).t()
        return self._nvfp4_expert(e, x)

    def gated(self, gu: torch.Tensor) -> torch.Tensor:
        """The activation on a kernel GEMM1 output gu [n, 2I] (gate | up, already rounded to the activation
        dtype, its scales folded in) -> h [n, I]: on CUDA one launch rounding h to gu's dtype, elsewhere fp32;
        the caller rounds h to the activation dtype for GEMM2 (the same bits either way)."""
        a = self.activation
        return gated(gu, a.kind, a.beta or 0.0, a.linear_beta, gu.dtype if gu.is_cuda else torch.float32)

    def int8_stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts repacked by K3RUN_CPU_INT8=1 seen in cpu_simd's vnni16 layout (views): w13
        [E, 2I/16, D/16, 128], its scales [E, 2I/16, D/16, 16], w2 [E, D/16, I/16, 128], its scales
        [E, D/16, I/16, 16]."""
        el, d, i = self.num_local, self.hidden_size, self.intermediate_size
        return (
            self.w13_weight.view(el, i // 8, d // 16, 128),
            self.w13_weight_scale.view(torch.uint8).view(el, i // 8, d // 16, 16),
            self.w2_weight.view(el, d // 16, i // 16, 128),
            self.w2_weight_scale.view(torch.uint8).view(el, d // 16, i // 16, 16),
        )

    def _nvfp4_expert_kernels(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """W4A16 through kernels/nvfp4_gemm: the global scales and the alphas ride in per-row decode scales
        (see process_after_loading); gate / up leave GEMM1 rounded to x's dtype, h enters GEMM2 in it."""
        from k3run.kernels.nvfp4_gemm import NvFp4Weight, nvfp4_linear

        assert self._kernel_scales is not None
        if self._cpu_int8 is not None:
            return self._nvfp4_expert_int8(e, x)
        gs13, gs2 = self._kernel_scales
        layout = ("tiled128" if self._tiled else "split128") if self._split128 else "checkpoint"
        w13 = NvFp4Weight(
            self.w13_weight[e], self.w13_weight_scale[e].view(torch.uint8), gs13[e], self.hidden_size, layout
        )
        w2 = NvFp4Weight(
            self.w2_weight[e],
            self.w2_weight_scale[e].view(torch.uint8),
            gs2[e],
            self.intermediate_size,
            layout,
        )
        return nvfp4_linear(self.gated(nvfp4_linear(x, w13)).to(x.dtype), w2)

    def _nvfp4_expert_int8(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """`_nvfp4_expert_kernels` on the CPU's int8-activation kernel (weights in place in its layout)."""
        from k3run.kernels.cpu_simd import Vnni16Weight, nvfp4_vnni_gemm

        assert self._cpu_int8 is not None
        gs13, gs2 = self._cpu_int8
        w13, s13, w2, s2 = (t[e] for t in self.int8_stacks())
        gu = nvfp4_vnni_gemm(x, Vnni16Weight(w13, s13, gs13[e], 2 * self.intermediate_size)).to(x.dtype)
        return nvfp4_vnni_gemm(self.gated(gu).to(x.dtype), Vnni16Weight(w2, s2, gs2[e], self.hidden_size)).to(
            x.dtype
        )

    def _nvfp4_block_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference expert e's codes times block scales, fp32 (w13 [2I, D], w2 [D, I]); the global scales
        live in the alphas, as in the kernel. From the cache `cache_reference_weights` fills, else decoded
        now (the decode validates its scales on the host: no CUDA-graph capture)."""
        if self._ref_stack is not None:
            return self._ref_stack[0][e], self._ref_stack[1][e]
        if self.w13_weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.prefix}: the NVFP4 reference experts decode their weights on the host side; call "
                "cache_reference_weights() before capturing a CUDA graph"
            )
        w13_codes, w13_scale, w2_codes, w2_scale = self.nvfp4_expert_tensors(e)
        return dequantize_nvfp4(w13_codes, w13_scale, 1.0), dequantize_nvfp4(w2_codes, w2_scale, 1.0)

    def _reference_bytes(self) -> int:
        """The bytes `cache_reference_weights` would keep: fp32 w13 and w2 of every local expert."""
        return 4 * self.num_local * 3 * self.hidden_size * self.intermediate_size

    def cache_reference_weights(self) -> None:
        """Keep every local NVFP4 reference expert's decoded weights (fp32) so the dense path needs no host
        work: for CUDA graphs of models whose experts cannot take the kernels (D or I not multiples of 128).
        Costs 8x the NVFP4 bytes of the local experts; the dense path allows at most DENSE_MAX_EXPERTS."""
        if self.algo != QuantAlgo.NVFP4 or self.nvfp4_kernels or self._ref_stack is not None:
            return
        decoded = [self._nvfp4_block_weights(e) for e in range(self.num_local)]
        self._ref_stack = (torch.stack([w13 for w13, _ in decoded]), torch.stack([w2 for _, w2 in decoded]))

    def _nvfp4_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        s = self.scales
        if s is None:
            raise RuntimeError(f"{self.prefix}: process_after_loading() was not called")
        if self.nvfp4_kernels:
            return self._nvfp4_expert_kernels(e, x)
        w13, w2 = self._nvfp4_block_weights(e)
        return self.nvfp4_reference(
            x, w13, w2, s.g1_alphas[e, 0], s.g1_alphas[e, 1], s.g1_scale_c[e], s.g2_alphas[e]
        )

    def nvfp4_reference(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, g1_gate: torch.Tensor,
        g1_up: torch.Tensor, g1_c: torch.Tensor, g2: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The NVFP4 expert in the kernel's form: GEMM accumulators over codes times block scales (w13
        [..., 2I, D], w2 [..., D, I] fp32), times the alphas. One expert (0-dim alphas; x [n, D] -> [n, D])
        or a stack of E (alphas [E, 1, 1]; -> [E, n, D]), in x's dtype."""
        s = self.scales
        assert s is not None
        i = self.intermediate_size
        w4a4 = self.nvfp4_act_mode == "w4a4"
        xin = x.float() * s.a1_gscale
        if w4a4:
            xin = nvfp4_qdq(xin, 1.0)
        acc = torch.matmul(xin, w13.transpose(-1, -2))  # [..., n, 2I] fp32 GEMM1 accumulator
        gate = acc[..., :i] * g1_gate
        if self.activation.kind == "silu":
            h = torch.nn.functional.silu(gate) * acc[..., i:] * g1_c
        else:
            up = acc[..., i:] * g1_up
            h = self.activation.on_halves(gate, up).float() * g1_c
        # h is already in GEMM2's encoded input domain (times a2_gscale)
        h = nvfp4_qdq(h, 1.0) if w4a4 else h.to(x.dtype).float()
        return (torch.matmul(h, w2.transpose(-1, -2)) * g2).to(x.dtype)

    def extra_repr(self) -> str:
        mode = f", nvfp4 {self.nvfp4_act_mode}" if self.algo == QuantAlgo.NVFP4 else ""
        if self.mxfp4:
            mode += " (checkpoint MXFP4, cast to NVFP4 at load)"
        return (
            f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts}, "
            f"{self.hidden_size}->{self.intermediate_size}, {self.activation}, {self.algo.value}{mode}"
        )


def fused_experts(
    experts: FusedExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    grouped: bool | None = None,
    dense: bool | None = None,
    out_dtype: torch.dtype = torch.float32,
    add: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The one dispatch point for the routed-expert computation: the fp32 sum over each token's picks,
    rounded to out_dtype, plus add() when given (the shared experts' output, called just before the sum
    so a side-stream branch is joined as late as possible): in the top-k combine's one launch where the
    path ends in it.

    NVFP4 kernels (`experts.grouped_ok`; grouped=False forces the loop): two grouped launches over all
    picks at any token count, no host synchronisation (`_fused_experts_grouped`: the decode kernels up to
    BY_EXPERT_MAX_TOKENS tokens, the tile GEMM from TILE_FROM_TOKENS). While a CUDA graph is being captured
    (or dense=True) and the grouped path does not apply: every local expert over every token, weighted by
    its routing weight (0 where not picked), also without a host synchronisation (`_fused_experts_dense`;
    up to DENSE_MAX_EXPERTS local experts). Otherwise a loop over the local
    experts that were hit: the (token, slot) picks are grouped by expert with one stable sort, and the
    per-expert counts are read back once: one host synchronisation per call (a nonzero() per expert would
    cost one each). Within an expert the picks stay in (token, slot) order, so the fp32 accumulation order
    is fixed.
    """
    finish = _Finish(out_dtype, add)
    if grouped is not False and experts.grouped_ok(x, ids):
        return _fused_experts_grouped(experts, x, ids, weights, finish)
    if grouped is not False and experts.grouped_mm_ok(x):
        return _fused_experts_grouped_mm(experts, x, ids, weights, finish)
    return finish.apply(_fused_experts_fp32(experts, x, ids, weights, grouped, dense))


@dataclass(frozen=True)
class _Finish:
    """What the routed experts' fp32 sum becomes: rounded to out_dtype, plus add() (fused_experts)."""

    out_dtype: torch.dtype = torch.float32
    add: Callable[[], torch.Tensor] | None = None

    def combine(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine(y, weights, self.out_dtype, None if self.add is None else self.add())

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        out = out.to(self.out_dtype)
        return out if self.add is None else out + self.add()


_FP32 = _Finish()


def _fused_experts_fp32(
    experts: FusedExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    grouped: bool | None,
    dense: bool | None,
) -> torch.Tensor:
    """fused_experts' paths that end in their own fp32 sum: the CPU int8 kernel, the dense form and the
    per-expert loop."""
    if grouped is not False and dense is not True and experts._cpu_int8 is not None:
        if not torch.compiler.is_compiling():
            return _fused_experts_int8(experts, x, ids, weights)
    if dense is None:
        dense = (
            torch.compiler.is_compiling()  # a compiled step cannot read counts back either
            or _SYNC_FREE.get()
            or (x.is_cuda and torch.cuda.is_current_stream_capturing())
        )
    if dense:
        if torch.compiler.is_compiling() and not x.is_cuda and ids.numel() < experts.num_local:
            y = _fused_experts_picked(experts, x, ids, weights)
            if y is not None:
                return y
        return _fused_experts_dense(experts, x, ids, weights)
    from k3run.kernels.picks import sort_picks

    out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float32, device=x.device)
    picks = ids.shape[1]
    _, order, counts_t = sort_picks((ids - experts.first).reshape(-1), experts.num_local)  # misses last
    counts = counts_t.tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        start += n
        tok, slot = sel // picks, sel % picks
        y = experts.expert(e, x[tok])
        out.index_add_(0, tok, y.float() * weights[tok, slot].float().unsqueeze(-1))
    return out


def _fused_experts_int8(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The per-expert loop's result, bit for bit, in two grouped calls of the CPU int8 kernel (experts
    repacked by K3RUN_CPU_INT8=1): the picks sorted by expert as the loop sorts them, GEMM1 over all of
    them, the activation on all of them at once, GEMM2, then the same index_add in the same order. Each
    pick's rows go through exactly the loop's operations (the kernel's per-row results do not depend on
    the rows beside them), so only the number of calls changes: 2 per layer instead of 2 per hit expert."""
    from k3run.kernels.cpu_simd import nvfp4_vnni_grouped
    from k3run.kernels.picks import sort_picks

    assert experts._cpu_int8 is not None
    gs13, gs2 = experts._cpu_int8
    el, d, i = experts.num_local, experts.hidden_size, experts.intermediate_size
    w13, s13, w2, s2 = experts.int8_stacks()
    picks = ids.shape[1]
    _, order, counts = sort_picks((ids - experts.first).reshape(-1), el)  # misses last
    offsets = torch.zeros(el + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    hit = order[: int(offsets[-1])]
    out = torch.zeros(x.shape[0], d, dtype=torch.float32)
    if hit.numel() == 0:
        return out
    tok, slot = hit // picks, hit % picks
    gu = nvfp4_vnni_grouped(x[tok], w13, s13, gs13, offsets, 2 * i).to(x.dtype)
    y = nvfp4_vnni_grouped(experts.gated(gu).to(x.dtype), w2, s2, gs2, offsets, d).to(x.dtype)
    out.index_add_(0, tok, y.float() * weights[tok, slot].float().unsqueeze(-1))
    return out


DENSE_MAX_EXPERTS = 16  # the dense path computes every local expert for every token
_SYNC_FREE: contextvars.ContextVar[bool] = contextvars.ContextVar("k3run_moe_sync_free", default=False)


@contextlib.contextmanager
def sync_free_experts() -> Iterator[None]:
    """Within: fused_experts never reads back from the device (the grouped or the dense path). The CUDA-graph
    runner wraps its warm-up step in it, so the warm-up compiles the kernels that the capture records."""
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)


def experts_sync_free(
    experts: FusedExperts, tokens: int, top_k: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """None when fused_experts can run `tokens` decode tokens (top_k picks each) of `dtype` on `device`
    without a host read-back, else why not (for the CUDA-graph runner's start-up check)."""
    x = torch.empty(tokens, experts.hidden_size, dtype=dtype, device=device)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)
    if experts.grouped_ok(x, ids) or experts.grouped_mm_ok(x) or experts.num_local <= DENSE_MAX_EXPERTS:
        return None
    return (
        f"{experts.prefix}: {experts.num_local} local experts need the grouped NVFP4 path for "
        f"{tokens} tokens (the dense fallback takes <= {DENSE_MAX_EXPERTS})"
    )


def _fused_experts_dense(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """fused_experts without a host synchronisation for any expert kind: every local expert runs over all T
    tokens and its output is added times the token's routing weight for it (0 where not picked: an exact +0
    for finite outputs). Costs num_local / A times the loop's expert work: for small expert counts (the
    bundled model) under a CUDA graph. bf16 and NVFP4 reference experts run as a handful of batched
    operations over all experts (`_all_experts`, a graph of few kernels); FP8_PB_WO experts one by one."""
    if experts.num_local > DENSE_MAX_EXPERTS:
        raise ValueError(
            f"{experts.prefix}: the dense expert path runs every local expert on every token; "
            f"{experts.num_local} local experts is over its limit of {DENSE_MAX_EXPERTS}"
        )
    if x.is_cuda:  # the NVFP4 reference experts decode on the host side: decode once, outside any capture
        experts.cache_reference_weights()
    t, el = x.shape[0], experts.num_local
    local = ids - experts.first  # [T, A]
    hit = (local >= 0) & (local < el)
    coef = torch.zeros(t, el + 1, dtype=torch.float32, device=x.device)  # column el collects the misses
    coef.scatter_add_(1, torch.where(hit, local, el), weights.float())
    coef = coef[:, :el].t()  # [E_l, T]: each expert's routing weight per token
    y = _all_experts(experts, x)  # [E_l, T, D] or None
    if y is not None:
        return (y.float() * coef.unsqueeze(-1)).sum(0)
    out = torch.zeros(t, experts.hidden_size, dtype=torch.float32, device=x.device)
    for e in range(el):
        out += experts.expert(e, x).float() * coef[e].unsqueeze(-1)
    return out


def _fused_experts_picked(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor | None:
    """fused_experts for a compiled CPU decode step with fewer picks than local experts: each (token, slot)
    pick runs its own expert, the weights gathered by expert id on the device (no read-back), so a step reads
    T * A experts' weights where the dense path reads all E_l (the bundled model: 2 of 8). The same
    operations per pick as `FusedExperts.expert` (fp32 accumulation, the activation dtype between the
    GEMMs); picks of another rank's experts weigh 0. None for the kinds it does not gather (FP8_PB_WO
    experts, NVFP4 experts on the kernels or without the decoded reference stack)."""
    t, a = ids.shape
    el = experts.num_local
    local = (ids - experts.first).reshape(-1)
    hit = (local >= 0) & (local < el)
    e = torch.where(hit, local, 0)
    w = torch.where(hit, weights.reshape(-1).float(), 0.0)  # [P]
    xp = x.repeat_interleave(a, dim=0)[:, None, :]  # [P, 1, D]: pick p is token p // A
    if experts.algo == QuantAlgo.NONE:
        w13 = experts.w13_weight[e].to(x.dtype).transpose(1, 2)  # [P, D, 2I]
        h = experts.activation(torch.matmul(xp, w13))
        y = torch.matmul(h, experts.w2_weight[e].to(x.dtype).transpose(1, 2))  # [P, 1, D]
    elif experts.algo == QuantAlgo.NVFP4 and not experts.nvfp4_kernels and experts._ref_stack is not None:
        s = experts.scales
        assert s is not None
        alphas = (s.g1_alphas[:, 0], s.g1_alphas[:, 1], s.g1_scale_c, s.g2_alphas)  # [E_l] each
        w13, w2 = experts._ref_stack[0][e], experts._ref_stack[1][e]
        y = experts.nvfp4_reference(xp, w13, w2, *(al[e][:, None, None] for al in alphas))
    else:
        return None
    return (y[:, 0].float() * w[:, None]).view(t, a, -1).sum(1)


def _all_experts(experts: FusedExperts, x: torch.Tensor) -> torch.Tensor | None:
    """Every local expert on every row of x [T, D] at once -> [E_l, T, D] in x's dtype, with the same
    operations as `FusedExperts.expert` per expert (batched matmuls); None for the kinds it does not batch."""
    if experts.algo == QuantAlgo.NONE:
        h = experts.activation(torch.matmul(x, experts.w13_weight.to(x.dtype).transpose(1, 2)))  # [E, T, 2I]
        return torch.matmul(h, experts.w2_weight.to(x.dtype).transpose(1, 2))
    if experts.algo != QuantAlgo.NVFP4 or experts.nvfp4_kernels or experts._ref_stack is None:
        return None
    s = experts.scales
    assert s is not None
    per_expert = (s.g1_alphas[:, 0], s.g1_alphas[:, 1], s.g1_scale_c, s.g2_alphas)  # [E_l] each
    return experts.nvfp4_reference(x, *experts._ref_stack, *(a[:, None, None] for a in per_expert))


def _by_expert(tokens: int) -> bool:
    return 2 <= tokens <= BY_EXPERT_MAX_TOKENS and os.environ.get("K3RUN_MOE_BY_EXPERT", "1") != "0"


def by_expert_tile(tokens: int) -> int:
    """The expert-major launch's token tile for a decode batch of `tokens` (BY_EXPERT_T32_FROM)."""
    forced = os.environ.get("K3RUN_MOE_BY_EXPERT_TILE")
    if forced:
        if forced not in ("8", "16", "32"):
            raise ValueError(f"K3RUN_MOE_BY_EXPERT_TILE: expected 8, 16 or 32, got {forced!r}")
        return int(forced)
    return 8 if tokens <= 8 else 16 if tokens < BY_EXPERT_T32_FROM else 32


def _local_ids(ids: torch.Tensor, first: int) -> torch.Tensor:
    """The picks' local expert ids [T * A] in ids' dtype (outside [0, num_local): another rank's expert);
    the kernels read int32 or int64, so rank 0 needs no launch at all."""
    flat = ids.reshape(-1)
    return flat if first == 0 else flat - first


def _fused_experts_grouped(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: _Finish = _FP32
) -> torch.Tensor:
    """fused_experts through two grouped NVFP4 launches: GEMM1, the activation, GEMM2 for every (token, slot)
    pick; picks of other ranks' experts give zero rows. For 2..BY_EXPERT_MAX_TOKENS tokens the launches are
    expert-major (`expert_groups` + `nvfp4_gemv_by_expert`: one program group per picked expert over all
    its tokens), otherwise one program group per pick (`nvfp4_gemv_grouped`; at equal split_k the two give
    the same bits).
    From TILE_FROM_TOKENS tokens (prefill) both GEMMs run on the tile GEMM instead (`_fused_experts_tile`).
    No host synchronisation, so a decode step can be captured in a CUDA graph. Sum over a token's picks in
    slot order, fp32."""
    if ids.shape[0] >= TILE_FROM_TOKENS or (ids.numel() > GROUPED_MAX_PICKS and not _by_expert(ids.shape[0])):
        return _fused_experts_tile(experts, x, ids, weights, finish)
    from k3run.kernels.nvfp4_gemm import one_wave_split, sm_count
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert, nvfp4_gemv_grouped
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    assert experts._kernel_scales is not None
    gs13, gs2 = experts._kernel_scales
    t, a = ids.shape
    d, i = experts.hidden_size, experts.intermediate_size
    local = _local_ids(ids, experts.first)
    sms = sm_count(x.device.index or 0)
    w13, s13 = experts.w13_weight, experts.w13_weight_scale.view(torch.uint8)
    w2, s2 = experts.w2_weight, experts.w2_weight_scale.view(torch.uint8)
    x = x.contiguous()
    by_expert = _by_expert(t)
    if by_expert:  # each picked expert's weights read once for all the tokens that picked it
        bt = by_expert_tile(t)
        grp = expert_groups(local, experts.num_local, bt)
        split1, reg1 = one_wave_split(bt, 2 * i * grp.shape[0], d, sms)
        kw1 = dict(picks=t * a, slot_div=a, rows=2 * i, split_k=split1, maxnreg=reg1)
        gu = nvfp4_gemv_by_expert(x, w13, s13, gs13, grp, **kw1)
    else:
        split1, reg1 = one_wave_split(1, 2 * i * t * a, d, sms)  # every pick's rows count towards one wave
        gu = nvfp4_gemv_grouped(x, w13, s13, gs13, local, rows=2 * i, split_k=split1, maxnreg=reg1)
    h = experts.gated(gu)
    if by_expert:
        split2, reg2 = one_wave_split(bt, d * grp.shape[0], i, sms)
        kw2 = dict(picks=t * a, slot_div=1, rows=d, split_k=split2, maxnreg=reg2)
        y = nvfp4_gemv_by_expert(h.to(x.dtype), w2, s2, gs2, grp, **kw2)
    else:
        split2, reg2 = one_wave_split(1, d * t * a, i, sms)
        y = nvfp4_gemv_grouped(h.to(x.dtype), w2, s2, gs2, local, rows=d, split_k=split2, maxnreg=reg2)
    return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero


# the tile GEMM's picks per block (its wgmma N; an expert's last block is padded to it). H200,
# bench/bench_tile.py, the two grouped launches at 256 / 1024 / 4096 tokens (K3 experts, 56 local; Kimi
# Linear's, 256): 64 with the default launch was the fastest or within 3% of it at every size, from 8 to
# 1170 picks per expert (16: 1.5-6x slower; 128 needs 8 warps and was not faster)
MOE_TILE_BM = 64


def _fused_experts_tile(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: _Finish = _FP32
) -> torch.Tensor:
    """The grouped experts on the tensor cores: the picks grouped by expert into blocks on the device
    (`expert_blocks`), GEMM1 over every block with the activation in its epilogue (gate and up rows with
    their own decode scales, each rounded to x's dtype first as the decode path stores them), GEMM2, and
    the fp32 sum over each token's picks in slot order (as the decode launches). On sm_90 with 16-bit
    activations both GEMMs run on the wgmma kernel (`wgmma.nvfp4_wgmma_grouped`, blocks of
    `wgmma_block_picks`), elsewhere on the Triton tile GEMM (blocks of MOE_TILE_BM)."""
    import k3run.kernels.nvfp4_gemm as ng
    from k3run.kernels.nvfp4_gemm.tile import expert_blocks, nvfp4_tile_gemm_grouped

    assert experts._kernel_scales is not None
    t, a = ids.shape
    local = _local_ids(ids, experts.first)
    x = x.contiguous()
    if x.dtype in (torch.float16, torch.bfloat16) and ng._wgmma_ok(x.device):
        from triton.compiler.errors import CompilationError

        from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_grouped

        grp = expert_blocks(local, experts.num_local, wgmma_block_picks(t * a, experts.num_local))
        try:
            y = _grouped_gemms(experts, x, a, grp, nvfp4_wgmma_grouped)
            return finish.combine(y, weights)
        except (CompilationError, RuntimeError) as e:  # a Triton that cannot build it: the tile GEMM
            if not isinstance(e, CompilationError) and "PassManager" not in str(e):
                raise
            ng._disable_wgmma(e)
    grp = expert_blocks(local, experts.num_local, MOE_TILE_BM)
    y = _grouped_gemms(experts, x, a, grp, nvfp4_tile_gemm_grouped)
    return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero


# the wgmma kernel's picks per block by the mean picks per local expert: (up to this mean, block) pairs, 128
# above. H200, bench/bench_wgmma.py --moe (RESULTS run 105; K3 experts 56 local, Kimi Linear's 256): 32-pick
# blocks best at means 2-18, 64 at 32-128 (within 3% of 128 at 73), 128 from 293 (64 there: 1.25x slower)
WGMMA_BLOCK_PICKS = ((24, 32), (160, 64))


def wgmma_block_picks(picks: int, local_experts: int) -> int:
    """Picks per block of the grouped wgmma GEMMs (WGMMA_BLOCK_PICKS): fewer padded rows in an expert's last
    block against more reads of its weights per pick."""
    mean = picks / max(local_experts, 1)
    return next((bt for most, bt in WGMMA_BLOCK_PICKS if mean <= most), 128)


def _grouped_gemms(experts: FusedExperts, x: torch.Tensor, a: int, grp: torch.Tensor, gemm) -> torch.Tensor:
    """GEMM1 (activation in the epilogue) and GEMM2 of the grouped experts over the block table grp with
    `gemm` (tile.nvfp4_tile_gemm_grouped or wgmma.nvfp4_wgmma_grouped): y [picks, D] in x's dtype."""
    gs13, gs2 = experts._kernel_scales
    picks = x.shape[0] * a
    d, i = experts.hidden_size, experts.intermediate_size
    s13, s2 = experts.w13_weight_scale.view(torch.uint8), experts.w2_weight_scale.view(torch.uint8)
    # GEMM1 with the activation in its epilogue: h [picks, I] (rows of picks in no block, another rank's
    # experts, are never written and never read)
    act = experts.activation
    h = gemm(
        x, experts.w13_weight, s13, gs13, grp, picks=picks, x_div=a, k=d,
        out=torch.empty(picks, i, dtype=x.dtype, device=x.device),
        activation=(act.kind, act.beta, act.linear_beta),
    )  # fmt: skip
    everything_local = experts.num_local == experts.num_experts
    y = (torch.empty if everything_local else torch.zeros)(picks, d, dtype=x.dtype, device=x.device)
    # GEMM2: rows of other ranks' picks are never written, so they must start as zeros for the sum
    return gemm(h, experts.w2_weight, s2, gs2, grp, picks=picks, x_div=1, k=i, out=y)


def _fused_experts_grouped_mm(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, finish: _Finish = _FP32
) -> torch.Tensor:
    """16-bit experts as two grouped GEMMs over the picks sorted by expert (torch._grouped_mm; on CPU tensors
    torch's own loop, which the tests use): the same operations as `FusedExperts.expert` per expert (GEMM1
    out in x's dtype, the activation, GEMM2), no host synchronisation (counts and offsets stay on the device),
    then the fp32 sum over each token's picks in slot order. Picks of other ranks' experts sort last, past
    the last offset, and count zero."""
    from k3run.kernels.picks import sort_picks

    t, a = ids.shape
    e = experts.num_local
    bucket, order, counts = sort_picks(ids.reshape(-1) - experts.first, e)
    valid = bucket < e
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // a]
    w13 = experts.w13_weight.to(x.dtype).transpose(1, 2)  # [E, D, 2I] (a view for matching dtypes)
    w2 = experts.w2_weight.to(x.dtype).transpose(1, 2)  # [E, I, D]
    h = experts.activation(torch._grouped_mm(xs, w13, offs=offs))  # [P, I] in x's dtype
    ys = torch._grouped_mm(h, w2, offs=offs)  # [P, D]
    y = torch.zeros_like(ys).index_copy_(0, order, ys)  # back in pick order
    y = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return finish.combine(y, weights)  # slot order, fp32; rows of other ranks' picks are zero


def _scalar(what: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise ValueError(f"{what}: expected a scalar, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{what}: expected a float scalar, got {t.dtype}")
    v = float(t.float().item())
    if not (v > 0 and v < float("inf")):
        raise ValueError(f"{what}: expected a positive finite scale, got {v}")
    return v


def _check_dtype(what: str, t: torch.Tensor, want: torch.dtype, allow_float_cast: bool) -> None:
    if t.dtype == want:
        return
    if allow_float_cast and t.is_floating_point() and t.dtype.itemsize > 1 and want.itemsize > 1:
        return
    raise ValueError(f"{what}: expected dtype {want}, got {t.dtype}")


class KimiMoE(nn.Module):
    """Router + routed experts (+ K3 latent projections) + shared experts; output [T, D] in x's dtype.

    Routed experts are split over the TP group as expert parallelism (each rank holds E/tp experts); their
    fp32 partial sums are all-reduced BEFORE the latent norm, which needs the full sum.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        router: RouterConfig,
        hidden_size: int,
        moe_intermediate_size: int,
        num_shared_experts: int,
        activation: GatedActivation,
        experts_algo: QuantAlgo,
        tp: TPInfo,
        params_dtype: torch.dtype,
        latent_size: int | None = None,
        latent_norm: nn.Module | None = None,
        latent_down: nn.Module | None = None,
        latent_up: nn.Module | None = None,
        shared_experts: nn.Module | None = None,
        nvfp4_act_mode: NvFp4ActMode = "w4a16",
        prefix: str = "mlp",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = MoERouter(num_experts, hidden_size, router)
        if (latent_size is None) != (latent_down is None) or (latent_down is None) != (latent_up is None):
            raise ValueError(f"{prefix}: latent MoE needs latent_size, latent_down and latent_up together")
        self.routed_expert_down_proj = latent_down
        self.routed_expert_up_proj = latent_up
        self.routed_expert_norm = latent_norm
        self.experts = FusedExperts(
            num_experts,
            latent_size or hidden_size,
            moe_intermediate_size,
            activation,
            experts_algo,
            ep=tp,
            params_dtype=params_dtype,
            nvfp4_act_mode=nvfp4_act_mode,
            prefix=f"{prefix}.experts",
        )
        self.shared_experts = shared_experts
        if num_shared_experts and shared_experts is None:
            raise ValueError(
                f"{prefix}: num_shared_experts={num_shared_experts} but no shared expert MLP given"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.shared_experts is not None:  # they see the ORIGINAL full-width x; beside the routed chain
            mlp = self.shared_experts
            # inline under TP: its all-reduce and the experts' must not run on two streams at once
            shared = Branch(lambda: mlp(x), x, enabled=self.tp.size == 1)
        weights, ids = self.gate(x)  # router on the full-width input
        if self.routed_expert_down_proj is None and self.tp.size == 1:
            # nothing between the experts' sum and the output: the cast and the shared add in its launch
            return self.experts(x, ids, weights, x.dtype, None if shared is None else shared.result)
        z = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        y = all_reduce(self.experts(z, ids, weights), self.tp).to(x.dtype)  # [T, D or latent]
        if self.routed_expert_down_proj is not None:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared.result()
        return y
