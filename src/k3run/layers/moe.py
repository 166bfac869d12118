"""Kimi MoE: fp32 sigmoid router, routed experts, shared experts, K3 latent MoE.

Routed experts (`FusedExperts`) are stored per rank as stacked tensors, named as vLLM names them after loading
(`w13_*`: w1 gate rows then w3 up rows, `w2_*`: the down projection); the formats (bf16, FP8_PB_WO, NVFP4;
MXFP4 checkpoints cast to NVFP4 as they load) and their kernels are schemes in quant/experts.py, which also
states the NVFP4 scale semantics. Expert parallelism: rank r of ep holds the experts [r*E/ep, (r+1)*E/ep);
its output is the partial sum over its experts and the caller all-reduces it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from k3run.distributed import TPInfo, all_reduce
from k3run.kernels.moe_ops import (
    PendingCombine,
    append_pick,
    gated,
    route_sigmoid_topk,
    router_logits_ref,
    sigmoid_topk,
)
from k3run.knobs import knobs
from k3run.layers.activation import GatedActivation
from k3run.layers.branch import Branch
from k3run.layers.norm import norm_weight_loader
from k3run.loader import SliceLoader, TensorSource
from k3run.quant.algo import QuantAlgo
from k3run.quant.experts import Finish, NvFp4ActMode, expert_scheme_for

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

    def forward(self, x: torch.Tensor, extra: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, A], ids int64 [T, A]); `extra` (an expert id) appends it to every token's picks
        at weight 1 (column A, in the top-k launch on CUDA)."""
        c = self.cfg
        if not _group_limited(c.num_expert_group, c.topk_group):  # two launches on CUDA
            return route_sigmoid_topk(
                x, self.weight, self.e_score_correction_bias, c.top_k, c.renormalize, c.routed_scaling_factor,
                extra,
            )  # fmt: skip
        logits = router_logits_ref(x, self.weight)  # [T, E] fp32
        weights, ids = route(
            logits,
            self.e_score_correction_bias,
            c.top_k,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            renormalize=c.renormalize,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        return append_pick(weights, ids, extra)


class FusedExperts(nn.Module):
    """E/ep routed experts of width hidden -> intermediate -> hidden with a gated activation; their format's
    numerics in `self.scheme` (quant/experts.py).

    `forward(x [T, D], ids [T, A], weights fp32 [T, A]) -> fp32 [T, D]`: sum over the top-k picks that land on
    this rank's experts of weight * expert(x) (fp32 accumulation, each expert output rounded to x's dtype
    first, as the reference combine does). Checkpoint tensors arrive through `weight_loader(param, tensor,
    (global_expert_id, "w1" | "w2" | "w3"[, "packed"]))`.
    """

    # The parameters the scheme registers (quant/experts.py `params`); which of them exist depends on the
    # format (every one has the weights; FP8_PB_WO and NVFP4 `*_weight_scale`; NVFP4 `*_weight_scale_2` and,
    # for NVFP4 checkpoints, `*_input_scale`).
    w13_weight: nn.Parameter
    w2_weight: nn.Parameter
    w13_weight_scale: nn.Parameter
    w2_weight_scale: nn.Parameter
    w13_weight_scale_2: nn.Parameter
    w2_weight_scale_2: nn.Parameter
    w13_input_scale: nn.Parameter
    w2_input_scale: nn.Parameter

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
        self.checkpoint_algo = algo
        self.scheme = expert_scheme_for(algo, nvfp4_act_mode, hidden_size, intermediate_size, prefix)
        self.algo = self.scheme.algo  # the format the experts run in (MXFP4 and W4A16_NVFP4: NVFP4)
        self.appended = 0  # experts stacked after the local ones for the grouped launches (append_expert)
        self._filled: set[tuple[str, int, str]] = set()
        self._expected: list[tuple[str, int, str]] = []
        for p in self.scheme.params(self):
            self._add(p.name, p.shape, p.dtype, p.local)

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

    def grouped_ok(self, x: torch.Tensor) -> bool:
        """Whether fused_experts takes the scheme's grouped launches for x (every pick at once, no host
        synchronisation): NVFP4 kernels on tiled128 weights or bf16 experts on torch._grouped_mm."""
        return self.scheme.grouped_ok(self, x)

    @property
    def num_stacked(self) -> int:
        """Rows of the stacked expert tensors: the local experts, then any appended one (KimiMoE's shared
        expert, which only the grouped launches run)."""
        return self.num_local + self.appended

    def is_local(self, expert_id: int) -> bool:
        return self.first <= expert_id < self.first + self.num_local

    def has_filled(self, name: str, row: int, which: str) -> bool:
        """Whether the checkpoint tensor of local row `row`, shard `which`, has filled parameter `name`."""
        return (name, row + self.first, which) in self._filled

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
        filled = [(n, eid, which) for n in self.scheme.filled_by(name, kind)]
        if any(f in self._filled for f in filled):
            raise ValueError(f"{what}: loaded twice")
        row = eid - self.first if local else eid
        self.scheme.store(self, what, name, kind, param, source.read(), row, which)
        self._filled.update(filled)
        self.scheme.after_load(self, what, kind, row, which)

    def process_after_loading(self) -> None:
        self.scheme.process_after_loading(self)

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        out_dtype: torch.dtype = torch.float32,
        add: Callable[[], torch.Tensor] | None = None,
        sync_free: bool = False,
        defer: bool = False,
    ) -> torch.Tensor | PendingCombine:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"{self.prefix}: expected x [T, {self.hidden_size}], got {tuple(x.shape)}")
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"{self.prefix}: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T, A]"
            )
        return fused_experts(
            self, x, ids, weights, out_dtype=out_dtype, add=add, sync_free=sync_free, defer=defer
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """One local expert e on x [n, D] -> [n, D] in x's dtype."""
        return self.scheme.expert(self, e, x)

    def gated(self, gu: torch.Tensor) -> torch.Tensor:
        """The activation on a kernel GEMM1 output gu [n, 2I] (gate | up, already rounded to the activation
        dtype, its scales folded in) -> h [n, I]: on CUDA one launch rounding h to gu's dtype, elsewhere fp32;
        the caller rounds h to the activation dtype for GEMM2 (the same bits either way)."""
        a = self.activation
        return gated(gu, a.kind, a.beta or 0.0, a.linear_beta, gu.dtype if gu.is_cuda else torch.float32)

    def extra_repr(self) -> str:
        return (
            f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts}, "
            f"{self.hidden_size}->{self.intermediate_size}, {self.activation}, {self.scheme.describe()}"
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
    sync_free: bool = False,
    defer: bool = False,
) -> torch.Tensor | PendingCombine:
    """The one dispatch point for the routed-expert computation: the fp32 sum over each token's picks,
    rounded to out_dtype, plus add() when given (the shared experts' output, called just before the sum
    so a side-stream branch is joined as late as possible): in the top-k combine's one launch where the
    path ends in it, or, with `defer` on the grouped launches, left to the consumer as a PendingCombine
    (the next RMSNorm runs it in its own launch).

    The scheme's grouped launches where they take x (`experts.grouped_ok`; grouped=False forces the loop):
    every pick at once, no host synchronisation. Where they do not apply and the step must not read back
    from the device (`sync_free`: a step a CUDA graph records or a compiled step runs, and its warm-up; also
    while a capture or a compile is under way), or with dense=True: every local expert over every token,
    weighted by its routing weight (0 where not picked), also without a host synchronisation
    (`_fused_experts_dense`; up to DENSE_MAX_EXPERTS local experts). Otherwise a loop over the local experts
    that were hit: the (token, slot) picks are grouped by expert with one stable sort, and the per-expert
    counts are read back once: one host synchronisation per call (a nonzero() per expert would cost one
    each). Within an expert the picks stay in (token, slot) order, so the fp32 accumulation order is fixed.
    """
    finish = Finish(out_dtype, add, defer)
    if grouped is not False and experts.grouped_ok(x):
        return experts.scheme.grouped(experts, x, ids, weights, finish)
    return finish.apply(_fused_experts_fp32(experts, x, ids, weights, grouped, dense, sync_free))


def _fused_experts_fp32(
    experts: FusedExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    grouped: bool | None,
    dense: bool | None,
    sync_free: bool = False,
) -> torch.Tensor:
    """fused_experts' paths that end in their own fp32 sum: the scheme's grouped form of the loop (the CPU
    int8 kernel), the dense form and the per-expert loop."""
    if grouped is not False and dense is not True:
        y = experts.scheme.loop_sum(experts, x, ids, weights)
        if y is not None:
            return y
    if dense is None:
        dense = (
            torch.compiler.is_compiling()  # a compiled step cannot read counts back either
            or sync_free
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


DENSE_MAX_EXPERTS = 16  # the dense path computes every local expert for every token


def experts_sync_free(
    experts: FusedExperts, tokens: int, top_k: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """None when fused_experts can run `tokens` decode tokens (top_k picks each) of `dtype` on `device`
    without a host read-back, else why not (for the CUDA-graph runner's start-up check)."""
    x = torch.empty(tokens, experts.hidden_size, dtype=dtype, device=device)
    if experts.grouped_ok(x) or experts.num_local <= DENSE_MAX_EXPERTS:
        return None
    return (
        f"{experts.prefix}: {experts.num_local} local {experts.algo.value} experts have no grouped launches "
        f"for {dtype} on {device} at {tokens} tokens (the dense fallback takes <= {DENSE_MAX_EXPERTS})"
    )


def _fused_experts_dense(
    experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """fused_experts without a host synchronisation for any expert kind: every local expert runs over all T
    tokens and its output is added times the token's routing weight for it (0 where not picked: an exact +0
    for finite outputs). Costs num_local / A times the loop's expert work: for small expert counts (the
    bundled model) under a CUDA graph. The scheme's batched form (`all_experts`: bf16 and NVFP4 reference
    experts, a graph of few kernels) where it has one, else expert by expert."""
    if experts.num_local > DENSE_MAX_EXPERTS:
        raise ValueError(
            f"{experts.prefix}: the dense expert path runs every local expert on every token; "
            f"{experts.num_local} local experts is over its limit of {DENSE_MAX_EXPERTS}"
        )
    if x.is_cuda:  # outside any capture: e.g. the NVFP4 reference decodes its weights on the host side
        experts.scheme.prepare_dense(experts)
    t, el = x.shape[0], experts.num_local
    local = ids - experts.first  # [T, A]
    hit = (local >= 0) & (local < el)
    coef = torch.zeros(t, el + 1, dtype=torch.float32, device=x.device)  # column el collects the misses
    coef.scatter_add_(1, torch.where(hit, local, el), weights.float())
    coef = coef[:, :el].t()  # [E_l, T]: each expert's routing weight per token
    y = experts.scheme.all_experts(experts, x)  # [E_l, T, D] or None
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
    GEMMs); picks of another rank's experts weigh 0. None for the kinds the scheme does not gather
    (FP8_PB_WO experts, NVFP4 experts on the kernels or without the decoded reference stack)."""
    t, a = ids.shape
    el = experts.num_local
    local = (ids - experts.first).reshape(-1)
    hit = (local >= 0) & (local < el)
    e = torch.where(hit, local, 0)
    w = torch.where(hit, weights.reshape(-1).float(), 0.0)  # [P]
    xp = x.repeat_interleave(a, dim=0)[:, None, :]  # [P, 1, D]: pick p is token p // A
    y = experts.scheme.picked(experts, xp, e)  # [P, 1, D] or None
    if y is None:
        return None
    return (y[:, 0].float() * w[:, None]).view(t, a, -1).sum(1)


class KimiMoE(nn.Module):
    """Router + routed experts (+ K3 latent projections) + shared experts; output [T, D] in x's dtype.

    Routed experts are split over the TP group as expert parallelism (each rank holds E/tp experts); their
    fp32 partial sums are all-reduced BEFORE the latent norm, which needs the full sum.

    The shared expert as one more routed expert (`fuse_shared`, at load, where `shared_fusion_blocker` finds
    nothing against it: one GPU, no latent projections, NVFP4 W4A16 linears of the routed experts' widths
    and activation, the routed experts on the grouped kernels): its weights are stacked after the local
    experts, and for small decode batches (up to K3RUN_MOE_FUSE_SHARED tokens, default 8: the sizes measured
    on the full-depth model, 1.008x / 1.021x decode at batch 1 / 8; at batch 32 the fused random model's own
    routing spread over 162 experts where the unfused one's stayed on 8, not yet explained, so larger batches
    run it apart by default) the router appends it to every
    token's picks at weight 1, so the routed experts' two grouped launches also run it (Kimi Linear: 3 of a
    layer's ~11 decode launches fewer). Its output then joins the routed sum in fp32 and the sum is rounded
    once, where the separate shared expert's output is added to the rounded routed sum (a one-ulp
    difference at most). Larger batches and non-16-bit inputs keep the separate linears, so the shared
    expert's weights are held twice (Kimi Linear: 3.5 MB a layer, ~92 MB in all; `k3run plan` does not
    count the copy).
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
        self.shared_index: int | None = None  # the shared expert's row in the expert stacks once fused
        self.prefix = prefix
        if num_shared_experts and shared_experts is None:
            raise ValueError(
                f"{prefix}: num_shared_experts={num_shared_experts} but no shared expert MLP given"
            )

    def process_after_loading(self) -> None:
        """After the children's processing (the loader runs children first): the shared expert joins the
        routed experts' grouped launches where it can (K3RUN_MOE_FUSE_SHARED=0 keeps it apart)."""
        if self.shared_index is None and knobs().moe_fuse_shared > 0 and self.shared_fusion_blocker() is None:
            self.fuse_shared()

    def shared_fusion_blocker(self) -> str | None:
        """None when the shared expert can run as one more expert of the routed experts' grouped launches
        (after loading), else why not."""
        from k3run.layers.mlp import GatedMLP
        from k3run.quant.experts import NvFp4Experts
        from k3run.quant.schemes import NvFp4Scheme

        mlp, ex = self.shared_experts, self.experts
        if not isinstance(mlp, GatedMLP):
            return "no shared expert"
        if self.tp.size > 1:
            return "tensor parallel: the shared expert is split by rows, the routed experts by expert"
        if self.routed_expert_down_proj is not None:
            return "latent MoE: the routed experts see the latent, the shared expert the full width"
        sch = ex.scheme
        if not (isinstance(sch, NvFp4Experts) and sch.kernels and sch.tiled and sch.cpu_int8 is None):
            return f"the routed experts ({sch.describe()}) have no grouped NVFP4 launches here"
        gu, down = mlp.gate_up_proj, mlp.down_proj
        for lin in (gu, down):
            if not isinstance(lin.scheme, NvFp4Scheme) or lin.scheme.w4a4:
                return f"{lin.prefix}: {lin.scheme.describe()}, not a W4A16 NVFP4 linear"
            if getattr(lin, "bias", None) is not None:
                return f"{lin.prefix}: has a bias"
            if not hasattr(lin, "nvfp4_weight"):
                return f"{lin.prefix}: not processed after loading"
        d, i = ex.hidden_size, ex.intermediate_size
        widths = (gu.input_size_per_partition, gu.local_output_sizes, down.input_size_per_partition)
        if widths != (d, (i, i), i) or down.local_output_sizes != (d,):
            return f"shared expert {widths[0]} -> {widths[1]} -> {down.local_output_sizes}, routed {d} -> {i}"
        a, b = mlp.activation, ex.activation
        if (a.kind, a.beta, a.linear_beta) != (b.kind, b.beta, b.linear_beta):
            return f"shared expert activation {a}, routed {b}"
        return None

    def fuse_shared(self) -> None:
        """Stack the shared expert after the local routed experts (`NvFp4Experts.append_expert`); forward
        then appends it to the picks of small decode batches. Its own linears stay for the other inputs."""
        why = self.shared_fusion_blocker()
        if why is not None:
            raise ValueError(f"{self.prefix}: the shared expert cannot join the routed experts: {why}")
        mlp = self.shared_experts
        gu, down = mlp.gate_up_proj, mlp.down_proj  # type: ignore[union-attr]
        rows = 2 * self.experts.intermediate_size
        gs13 = gu.nvfp4_weight.row_global_scale.float().expand(rows).contiguous()
        gs2 = down.nvfp4_weight.row_global_scale.float().reshape(-1)
        if gs2.numel() != 1:
            raise ValueError(f"{down.prefix}: one decode scale expected, got {gs2.numel()}")
        self.shared_index = self.experts.scheme.append_expert(  # type: ignore[attr-defined]
            self.experts,
            (gu.weight.data, gu.weight_scale.data, gs13),
            (down.weight.data, down.weight_scale.data, gs2),
            f"{self.prefix}.shared_experts",
        )

    def forward(
        self, x: torch.Tensor, sync_free: bool = False, defer: bool = False
    ) -> torch.Tensor | PendingCombine:
        """sync_free: the step must read nothing back from the device (ForwardContext.sync_free). defer: the
        caller takes a PendingCombine (the next RMSNorm's `add` runs the top-k sum in its launch) where the
        routed sum is the layer's last operation on the grouped launches; a tensor otherwise."""
        decode = x.shape[0] <= knobs().moe_fuse_shared
        if self.shared_index is not None and decode and self.experts.grouped_ok(x):
            # the shared expert as pick A of every token, in the routed experts' grouped launches
            weights, ids = self.gate(x, extra=self.shared_index)
            return self.experts(x, ids, weights, x.dtype, sync_free=sync_free, defer=defer)
        shared = None
        if self.shared_experts is not None:  # they see the ORIGINAL full-width x; beside the routed chain
            mlp = self.shared_experts
            # inline under TP: its all-reduce and the experts' must not run on two streams at once
            shared = Branch(lambda: mlp(x), x, enabled=self.tp.size == 1)
        weights, ids = self.gate(x)  # router on the full-width input
        if self.routed_expert_down_proj is None and self.tp.size == 1:
            # nothing between the experts' sum and the output: the cast and the shared add in its launch
            add = None if shared is None else shared.result
            return self.experts(x, ids, weights, x.dtype, add, sync_free=sync_free, defer=defer)
        z = x if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x)
        y = self.experts(z, ids, weights, sync_free=sync_free)
        assert isinstance(y, torch.Tensor)
        y = all_reduce(y, self.tp).to(x.dtype)  # [T, D or latent]
        if self.routed_expert_down_proj is not None:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared.result()
        return y
