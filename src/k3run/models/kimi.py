"""KimiForCausalLM: the Kimi Linear and Kimi K3 text decoders, and their checkpoint-name table.

Layer i: a KDA or MLA mixer (config.layer_is_kda), then a dense gated MLP or a MoE (config.layer_is_moe).
Kimi Linear uses the plain pre-norm residual stream; K3 (attn_res_block_size set) uses block attention
residuals (layers/attn_res.py) and mixes the final output over the blocks before the last norm.

Parameter names are the checkpoint's module names without the root prefix (`model.` or
`language_model.model.`), except where layers are fused: `CHECKPOINT_TABLE` / `checkpoint_mapping` map
every checkpoint tensor of both namings onto (parameter, shard id):
  - original (Moonshot, `save_pretrained`): block_sparse_moe.experts.N.w1/w2/w3, self_attn.{q,k,v}_conv1d,
    self_attn.{f_a_proj,f_b_proj,A_log,dt_bias}, A_log [H], legacy [1,1,H,1] or K3's [K]; moonshotai/Kimi-K3's
    MXFP4 experts as experts.N.wK.weight_packed + weight_scale;
  - transformers-5 / ModelOpt export: mlp.experts.N.{gate,up,down}_proj, self_attn.conv1d [3P,1,W],
    self_attn.forget_gate.{f_a_proj,f_b_proj,A_log,dt_bias}, mlp.gate, mlp.shared_experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn

from k3run.config import ModelConfig
from k3run.distributed import NO_TP, TPInfo
from k3run.forward_context import ForwardContext, KDALayerCache, MLALayerCache, ModelCache
from k3run.kernels.moe_ops import PendingCombine
from k3run.knobs import knobs
from k3run.layers.activation import GatedActivation
from k3run.layers.attn_res import AttnResState, AttnResWeights, attn_res_layer
from k3run.layers.kda import KimiDeltaAttention
from k3run.layers.linear import ColumnParallelLinear, ReplicatedLinear
from k3run.layers.mla import KimiMLA
from k3run.layers.mlp import GatedMLP
from k3run.layers.moe import KimiMoE, RouterConfig, experts_sync_free
from k3run.layers.norm import RMSNorm, norm_weight_loader
from k3run.loader import IGNORE, Target
from k3run.quant.algo import QuantAlgo
from k3run.quant.experts import NvFp4ActMode

if TYPE_CHECKING:
    from k3run.quant.modelopt import QuantConfig
    from k3run.safetensors_io import TensorInfo

# The MLA latent norms use Kimi's RMSNorm default (official code and HF), not rms_norm_eps.
MLA_LATENT_NORM_EPS = 1e-6

_ROOTS = ("language_model.model.", "model.language_model.", "model.")
_LM_HEADS = ("language_model.lm_head.", "lm_head.")


class KimiDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        idx: int,
        *,
        qcfg: QuantConfig | None,
        tp: TPInfo,
        params_dtype: torch.dtype,
        nvfp4_moe_act: NvFp4ActMode,
    ) -> None:
        super().__init__()
        self.idx = idx
        self.is_kda = cfg.is_kda_layer(idx)
        self.is_moe = cfg.is_moe_layer(idx)
        prefix = f"model.layers.{idx}"
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, params_dtype)
        lin = {"qcfg": qcfg, "tp": tp, "params_dtype": params_dtype}
        self.self_attn: KimiDeltaAttention | KimiMLA
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(
                cfg.hidden_size,
                cfg.kda_num_heads,
                cfg.kda_head_dim,
                conv_kernel_size=cfg.conv_kernel_size,
                use_full_rank_gate=cfg.use_full_rank_gate,
                gate_lower_bound=cfg.gate_lower_bound,
                rms_norm_eps=eps,
                prefix=f"{prefix}.self_attn",
                **lin,
            )
        else:
            self.self_attn = KimiMLA(
                cfg.hidden_size,
                cfg.num_attention_heads,
                q_lora_rank=cfg.q_lora_rank,
                kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim,
                use_output_gate=cfg.mla_use_output_gate,
                latent_norm_eps=MLA_LATENT_NORM_EPS,
                prefix=f"{prefix}.self_attn",
                **lin,
            )
        act = GatedActivation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        self.mlp: GatedMLP | KimiMoE
        if self.is_moe:
            self.mlp = _make_moe(cfg, act, f"{prefix}.mlp", qcfg, tp, params_dtype, nvfp4_moe_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, prefix=f"{prefix}.mlp", **lin)
        self.attn_res_block_size = cfg.attn_res_block_size
        if cfg.uses_attn_res:
            self.self_attention_res = AttnResWeights(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
            self.mlp_res = AttnResWeights(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)

    def forward(
        self,
        h: torch.Tensor | AttnResState,
        ctx: ForwardContext,
        layer_cache: KDALayerCache | MLALayerCache | None,
        pending: torch.Tensor | PendingCombine | None = None,
    ) -> tuple[torch.Tensor | AttnResState, torch.Tensor | PendingCombine | None]:
        """The plain pre-norm stream: h is the residual stream without `pending`, the previous layer's MLP
        output, whose add runs fused into this layer's input norm (as the attention output's into the
        post-attention norm); returns (the stream after the attention, this layer's MLP output: with
        K3RUN_MOE_COMBINE_IN_NORM >= the step's tokens an MoE's routed sum still to be taken, which the next
        norm does in its launch). K3's AttnResState is updated in place and returned with None."""
        if isinstance(h, AttnResState):
            if pending is not None:
                raise ValueError(f"layer {self.idx}: an AttnRes stream carries no pending residual")

            def mixer(x: torch.Tensor) -> torch.Tensor:
                return self.self_attn(self.input_layernorm(x), ctx, layer_cache)  # type: ignore[arg-type]

            def mlp(x: torch.Tensor) -> torch.Tensor:
                out = self._mlp(self.post_attention_layernorm(x), ctx)
                assert isinstance(out, torch.Tensor)
                return out

            block = self.attn_res_block_size or 0  # set whenever the state is an AttnResState
            attn_res_layer(h, self.idx, block, mixer, mlp, self.self_attention_res, self.mlp_res)
            return h, None
        x, h = self.input_layernorm.add(h, pending)
        x, h = self.post_attention_layernorm.add(h, self.self_attn(x, ctx, layer_cache))  # type: ignore[arg-type]
        return h, self._mlp(x, ctx, defer=0 < x.shape[0] <= knobs().moe_combine_in_norm)

    def _mlp(
        self, x: torch.Tensor, ctx: ForwardContext, defer: bool = False
    ) -> torch.Tensor | PendingCombine:
        if isinstance(self.mlp, KimiMoE):  # the step's plan reaches the routed experts
            return self.mlp(x, sync_free=ctx.sync_free, defer=defer)
        return self.mlp(x)


def _make_moe(
    cfg: ModelConfig,
    act: GatedActivation,
    prefix: str,
    qcfg: QuantConfig | None,
    tp: TPInfo,
    params_dtype: torch.dtype,
    nvfp4_moe_act: NvFp4ActMode,
) -> KimiMoE:
    if cfg.num_experts is None:
        raise ValueError(f"{prefix}: a MoE layer needs num_experts")
    lin = {"qcfg": qcfg, "tp": tp, "params_dtype": params_dtype}
    latent = cfg.routed_expert_hidden_size
    down = up = norm = None
    if latent is not None:
        # replicated: the latent is shared by every rank's experts; up-proj of the full (all-reduced) sum
        down = ReplicatedLinear(cfg.hidden_size, latent, prefix=f"{prefix}.routed_expert_down_proj", **lin)
        up = ReplicatedLinear(latent, cfg.hidden_size, prefix=f"{prefix}.routed_expert_up_proj", **lin)
        if cfg.latent_moe_use_norm:
            norm = RMSNorm(latent, cfg.rms_norm_eps, params_dtype)
    shared = None
    if cfg.num_shared_experts:
        shared = GatedMLP(
            cfg.hidden_size, cfg.shared_intermediate_size, act, prefix=f"{prefix}.shared_experts", **lin
        )
    bank = f"{prefix}.experts"
    experts_algo = QuantAlgo.NONE if qcfg is None else qcfg.resolve(bank, num_experts=cfg.num_experts)
    return KimiMoE(
        num_experts=cfg.num_experts,
        router=RouterConfig(
            top_k=cfg.num_experts_per_token,
            num_expert_group=cfg.num_expert_group,
            topk_group=cfg.topk_group,
            renormalize=cfg.moe_renormalize,
            routed_scaling_factor=cfg.routed_scaling_factor,
        ),
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_shared_experts=cfg.num_shared_experts,
        activation=act,
        experts_algo=experts_algo,
        tp=tp,
        params_dtype=params_dtype,
        latent_size=latent,
        latent_norm=norm,
        latent_down=down,
        latent_up=up,
        shared_experts=shared,
        nvfp4_act_mode=nvfp4_moe_act,
        prefix=prefix,
    )


class KimiForCausalLM(nn.Module):
    """Kimi Linear / K3 text decoder.

    forward(input_ids [T], ctx) -> final-normed hidden [T, D]; compute_logits(hidden) -> fp32 [T, V];
    logits(input_ids) -> fp32 [T, V] for one sequence without a cache.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        qcfg: QuantConfig | None = None,
        tp: TPInfo = NO_TP,
        params_dtype: torch.dtype = torch.bfloat16,
        nvfp4_moe_act: NvFp4ActMode = "w4a16",
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.params_dtype = params_dtype
        # Replicated embedding: the lookup needs no collective; the vocab-parallel lm_head gathers.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=params_dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = norm_weight_loader  # type: ignore[attr-defined]
        self.layers = nn.ModuleList(
            KimiDecoderLayer(cfg, i, qcfg=qcfg, tp=tp, params_dtype=params_dtype, nvfp4_moe_act=nvfp4_moe_act)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        if cfg.uses_attn_res:
            self.output_attn_res = AttnResWeights(cfg.hidden_size, cfg.rms_norm_eps, params_dtype)
        self.lm_head: ColumnParallelLinear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(
                cfg.hidden_size,
                cfg.vocab_size,
                gather_output=True,
                qcfg=qcfg,
                prefix="lm_head",
                tp=tp,
                params_dtype=params_dtype,
            )

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids: expected a 1-D [T] tensor, got shape {tuple(input_ids.shape)}")
        if ctx.num_tokens != input_ids.shape[0]:  # the host copy: no device sync
            raise ValueError(
                f"input_ids: {input_ids.shape[0]} tokens but ctx's sequences hold {ctx.num_tokens}"
            )
        caches: Sequence[KDALayerCache | MLALayerCache | None]
        caches = ctx.cache.layers if ctx.cache is not None else [None] * len(self.layers)
        if len(caches) != len(self.layers):
            raise ValueError(f"ctx.cache has {len(caches)} layers, the model {len(self.layers)}")
        x = self.embed_tokens(input_ids)  # [T, D]
        h: torch.Tensor | AttnResState = AttnResState(prefix=x) if self.config.uses_attn_res else x
        pending: torch.Tensor | PendingCombine | None = None  # the last MLP output, added in the next norm
        for layer, cache in zip(self.layers, caches, strict=True):
            h, pending = layer(h, ctx, cache, pending)
        if isinstance(h, AttnResState):
            return self.norm(self.output_attn_res(h.candidates()))
        return self.norm.add(h, pending)[0]

    def static_decode_blocker(self, batch_size: int) -> str | None:
        """None when a decode step of `batch_size` sequences can run as a static step (ForwardContext
        attn_window) that a CUDA graph captures (or, on the CPU, torch.compile compiles whole), else the
        first reason it cannot, naming the layer."""
        device = self.embed_tokens.weight.device
        if device.type not in ("cuda", "cpu"):
            return f"the model is on {device}: static decode steps need CUDA or the CPU"
        if device.type == "cpu" and self.tp.size > 1:
            return "compiled CPU decode runs at tensor-parallel size 1 only"
        if device.type == "cuda" and self.tp.size > 1:  # NCCL collectives are captured with the step
            backend = torch.distributed.get_backend(self.tp.group)
            if backend != "nccl":
                return f"tensor parallel over {self.tp.size} ranks on {backend} (graphs capture NCCL only)"
        return self._layers_blocker(batch_size, device, absorbed_mla=True)

    def _layers_blocker(self, tokens: int, device: torch.device, absorbed_mla: bool) -> str | None:
        """The first layer that keeps a step of `tokens` rows out of a graph: on CUDA, KDA without fla's
        kernels, or (absorbed_mla: the static decode step's attention) MLA without its absorbed factors; on
        any device, routed experts without a host-sync-free path (on the CPU the references run, every one
        trace-safe)."""
        for layer in self.layers:
            attn = layer.self_attn
            if device.type == "cuda" and isinstance(attn, KimiDeltaAttention):
                from k3run.kernels.kda import kda_backend

                if kda_backend(device) != "fla":
                    return f"{attn.prefix}: KDA runs the reference (fla-core is not installed)"
            elif device.type == "cuda" and absorbed_mla and attn.w_uk is None:
                return f"{attn.prefix}: no absorbed kv_b factors (process_after_loading not called)"
            if isinstance(layer.mlp, KimiMoE):
                top_k = self.config.num_experts_per_token
                why = experts_sync_free(layer.mlp.experts, tokens, top_k, self.params_dtype, device)
                if why is not None:
                    return why
        return None

    def padded_prefill_blocker(self, tokens: int) -> str | None:
        """None when a prefill of one fresh sequence padded to `tokens` rows can run as a padded prefill
        (ForwardContext.padded_prefill) that a CUDA graph captures, else the first reason it cannot."""
        device = self.embed_tokens.weight.device
        if device.type != "cuda":
            return f"the model is on {device}: padded prefills are CUDA graphs"
        if self.tp.size > 1:
            return "padded prefills run at tensor-parallel size 1 only"
        if self.params_dtype not in (torch.bfloat16, torch.float16):
            return f"padded prefills run 16-bit activations, the model's are {self.params_dtype}"
        return self._layers_blocker(tokens, device, absorbed_mla=False)

    def static_step_bytes(self, batch_size: int, window: int) -> int:
        """The largest temporaries of one static decode step of `batch_size` sequences with MLA attention
        window `window` (the layers run one after another, so the largest layer's): what a captured graph of
        that step keeps in its memory pool."""
        return max(
            (
                layer.self_attn.static_attention_bytes(batch_size, window)
                for layer in self.layers
                if isinstance(layer.self_attn, KimiMLA)
            ),
            default=0,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return (hidden @ self.embed_tokens.weight.t()).float()
        return self.lm_head(hidden).float()  # [T, V]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of one sequence, no cache."""
        if input_ids.dim() != 1 or input_ids.dtype != torch.long:
            raise ValueError(
                "logits: expected a 1-D LongTensor of token ids, got "
                f"{input_ids.dtype} {tuple(input_ids.shape)}"
            )
        device = self.embed_tokens.weight.device
        ctx = ForwardContext.single(input_ids.shape[0], device=device)
        return self.compute_logits(self.forward(input_ids.to(device), ctx))

    def make_cache(self, num_slots: int, max_len: int) -> ModelCache:
        """Zeroed per-layer caches for `num_slots` sequences of up to `max_len` tokens (this rank's share)."""
        device = self.embed_tokens.weight.device
        layers: list[KDALayerCache | MLALayerCache | None] = []
        for layer in self.layers:
            attn = layer.self_attn
            if isinstance(attn, KimiDeltaAttention):
                layers.append(attn.init_cache(num_slots, self.params_dtype, device))
            else:
                layers.append(attn.init_cache(num_slots, max_len, self.params_dtype, device))
        return ModelCache(layers=layers)

    def checkpoint_mapping(self, name: str) -> list[Target] | tuple[Target, ...] | None:
        """Where checkpoint tensor `name` goes: [Target(param, shard_id)], IGNORE, or None if unknown."""
        targets = map_checkpoint_name(name, self)
        if targets and name.endswith(".input_scale"):
            # W4A16 layers (weight-only NVFP4) have no activation scale: the checkpoint's is unused
            kept = [t for t in targets if t.param in self._param_names]
            return kept or IGNORE
        return targets

    @cached_property
    def _param_names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.named_parameters())

    def held_dtypes(self, tensors: Mapping[str, TensorInfo]) -> list[HeldDtype]:
        """The dtype each floating-point checkpoint tensor is held in once loaded (the parameter it goes to),
        folded over layer and expert numbers. A quantized scheme's tensors (codes, FP8 weights, scales) are
        left out: the plan rows describe those."""
        params = dict(self.named_parameters())
        groups: dict[tuple[str, str, tuple[int, ...]], list] = {}
        for name, info in tensors.items():
            if info.dtype not in _FLOAT_CODES or name.endswith(_SCALE_SUFFIXES):
                continue
            key = (_NUMBER.sub("N", name), info.dtype, info.shape)
            if key in groups:
                groups[key][1] += 1
                continue
            held = None
            for t in self.checkpoint_mapping(name) or ():
                p = params.get(t.param)
                if p is not None and p.dtype.is_floating_point and p.element_size() > 1:
                    held = p.dtype
            groups[key] = [held, 1]
        return [
            HeldDtype(pattern, code, shape, held, n)
            for (pattern, code, shape), (held, n) in groups.items()
            if held is not None
        ]


_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")


@dataclass(frozen=True)
class HeldDtype:
    """Checkpoint tensors of one kind (layer and expert numbers folded to N) and the dtype held after load."""

    pattern: str
    stored: str  # safetensors dtype code
    shape: tuple[int, ...]
    held: torch.dtype
    count: int

    @property
    def rounded(self) -> bool:
        """Whether holding the values in `held` can change them (a narrower or different 16-bit format)."""
        src = _FLOAT_CODES[self.stored]
        if src == self.held:
            return False
        return not (self.held in (torch.float32, torch.float64) and src.itemsize < self.held.itemsize)

    def describe(self) -> str:
        what = (
            f"{self.pattern} ({self.stored} {list(self.shape)}{f' x{self.count}' if self.count > 1 else ''})"
        )
        return f"{what} -> {str(self.held).removeprefix('torch.')}{' (rounded)' if self.rounded else ''}"


def held_dtype_notes(groups: Sequence[HeldDtype], model_dtype: torch.dtype) -> list[str]:
    """The groups worth saying: rounded ones, and those held in a dtype other than the model's."""
    return [g.describe() for g in groups if g.rounded or g.held != model_dtype]


def _strip_root(name: str) -> str | None:
    for head in _LM_HEADS:
        if name.startswith(head):
            return "lm_head." + name[len(head) :]
    for root in _ROOTS:
        if name.startswith(root):
            return name[len(root) :]
    return None


# One table for both namings. Each row: regex over the root-stripped, `block_sparse_moe.` -> `mlp.`
# normalised name; a function of the match (and the model) giving the targets, or None to decline.
Rule = Callable[[re.Match[str], "KimiForCausalLM"], list[Target] | tuple[Target, ...] | None]
_SUFFIX = r"(?P<s>weight|weight_scale|weight_scale_2|input_scale|bias)"
_L = r"layers\.(?P<i>\d+)\."
# routed experts may also be compressed-tensors MXFP4: codes in weight_packed, E8M0 weight_scale
_EXPERT_SUFFIX = r"(?P<s>weight|weight_packed|weight_scale|weight_scale_2|input_scale|bias)"

_KDA_IN_PROJ = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj")
# transformers 5 nests the KDA forget-gate modules one level down: self_attn.forget_gate.<part>
_FORGET_GATE_PARTS = ("f_a_proj", "f_b_proj", "A_log", "dt_bias")
_FORGET = r"(?:forget_gate\.(?=(?:" + "|".join(_FORGET_GATE_PARTS) + r")\b))?"
# routed-expert projections: original name -> transformers-5 name (gate, down, up)
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_SHARD = {**{w: w for w in _EXPERT_NAMES}, **{v: k for k, v in _EXPERT_NAMES.items()}}


def _layer(model: KimiForCausalLM, m: re.Match[str]) -> KimiDecoderLayer | None:
    i = int(m["i"])
    return model.layers[i] if i < len(model.layers) else None  # type: ignore[return-value]


def _kda_in_proj(m: re.Match[str], model: KimiForCausalLM) -> list[Target] | None:
    layer = _layer(model, m)
    if layer is None or not layer.is_kda:
        return None
    attn: KimiDeltaAttention = layer.self_attn  # type: ignore[assignment]
    shard = attn.in_proj_shard_ids.get(m["p"])
    if shard is None:
        return None
    return [Target(f"layers.{m['i']}.self_attn.in_proj.{m['s']}", shard)]


def _kda_only(target: str) -> Rule:
    def rule(m: re.Match[str], model: KimiForCausalLM) -> list[Target] | None:
        layer = _layer(model, m)
        if layer is None or not layer.is_kda:
            return None
        return [Target(target.format(**m.groupdict()))]

    return rule


def _kda_conv(m: re.Match[str], model: KimiForCausalLM) -> list[Target] | None:
    layer = _layer(model, m)
    if layer is None or not layer.is_kda:
        return None
    shard = None if m["qkv"] is None else "qkv".index(m["qkv"])
    return [Target(f"layers.{m['i']}.self_attn.conv_weight", shard)]


def _same(m: re.Match[str], model: KimiForCausalLM) -> list[Target]:
    return [Target(m.string)]


def _gate_up(prefix: str) -> Rule:
    def rule(m: re.Match[str], model: KimiForCausalLM) -> list[Target]:
        return [Target(f"layers.{m['i']}.{prefix}.gate_up_proj.{m['s']}", 0 if m["p"] == "gate" else 1)]

    return rule


def _expert(m: re.Match[str], model: KimiForCausalLM) -> list[Target] | None:
    which = _EXPERT_SHARD[m["w"]]
    group = "w2" if which == "w2" else "w13"
    layer = _layer(model, m)
    if layer is None or not layer.is_moe:
        return None
    if m["s"] == "weight_packed":  # the codes: FusedExperts checks the bank is MXFP4
        return [Target(f"layers.{m['i']}.mlp.experts.{group}_weight", (int(m["e"]), which, "packed"))]
    return [Target(f"layers.{m['i']}.mlp.experts.{group}_{m['s']}", (int(m["e"]), which))]


def _attn_res(site: str) -> Rule:
    def rule(m: re.Match[str], model: KimiForCausalLM) -> list[Target]:
        which = "norm_weight" if m["k"] == "norm" else "proj_weight"
        head = f"layers.{m['i']}.{site}" if "i" in m.groupdict() else site
        return [Target(f"{head}.{which}")]

    return rule


CHECKPOINT_TABLE: tuple[tuple[re.Pattern[str], Rule], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        # routed experts first: they are nearly all of a K3 checkpoint's ~1M tensors
        (
            _L + r"mlp\.experts\.(?P<e>\d+)\.(?P<w>w[123]|gate_proj|up_proj|down_proj)\." + _EXPERT_SUFFIX,
            _expert,
        ),
        (r"embed_tokens\.weight|norm\.weight|lm_head\." + _SUFFIX, _same),
        (_L + r"(input_layernorm|post_attention_layernorm)\.weight", _same),
        # KDA: projections fused into in_proj (shard ids from the layer), forget-gate under either spelling
        (_L + r"self_attn\." + _FORGET + r"(?P<p>" + "|".join(_KDA_IN_PROJ) + r")\." + _SUFFIX, _kda_in_proj),
        (
            _L + r"self_attn\." + _FORGET + r"f_b_proj\." + _SUFFIX,
            _kda_only("layers.{i}.self_attn.f_b_proj.{s}"),
        ),
        (_L + r"self_attn\." + _FORGET + r"A_log", _kda_only("layers.{i}.self_attn.A_log")),
        (_L + r"self_attn\." + _FORGET + r"dt_bias", _kda_only("layers.{i}.self_attn.dt_bias")),
        (_L + r"self_attn\.(?:(?P<qkv>[qkv])_)?conv1d\.weight", _kda_conv),
        (_L + r"self_attn\.(g_a_proj|g_b_proj|o_proj)\." + _SUFFIX, _same),
        (_L + r"self_attn\.o_norm\.weight", _same),
        # MLA: checkpoint module names are the parameter names
        (
            _L + r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|g_proj)\." + _SUFFIX,
            _same,
        ),
        (_L + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", _same),
        # dense MLP / shared experts: gate and up fused
        (_L + r"mlp\.(?P<p>gate|up)_proj\." + _SUFFIX, _gate_up("mlp")),
        (_L + r"mlp\.shared_experts\.(?P<p>gate|up)_proj\." + _SUFFIX, _gate_up("mlp.shared_experts")),
        (_L + r"mlp\.(shared_experts\.)?down_proj\." + _SUFFIX, _same),
        (_L + r"mlp\.gate\.(weight|e_score_correction_bias)", _same),
        (_L + r"mlp\.(routed_expert_down_proj|routed_expert_up_proj)\." + _SUFFIX, _same),
        (_L + r"mlp\.routed_expert_norm\.weight", _same),
        (_L + r"self_attention_res_(?P<k>norm|proj)\.weight", _attn_res("self_attention_res")),
        (_L + r"mlp_res_(?P<k>norm|proj)\.weight", _attn_res("mlp_res")),
        (r"output_attn_res_(?P<k>norm|proj)\.weight", _attn_res("output_attn_res")),
    )
)

_MOE_RENAME = re.compile(r"(?<=\.)block_sparse_moe(?=\.)")
# Tensors a checkpoint may carry that the text decoder does not use.
_IGNORED = re.compile(
    r"(vision_tower|mm_projector|multi_modal_projector|vision_model)\.|.*rotary_emb\.inv_freq$"
)


# Quantization configs name modules under these roots too (the K3 converter lists "layers.N..." keys).
_CONFIG_ROOTS = (*_ROOTS, "language_model.", "")
_MOE_PART = re.compile(r"(?<![^.])(block_sparse_moe|mlp)(?=\.|$)")
_FORGET_PART = re.compile(r"(?<=\.self_attn\.)(forget_gate\.)?(" + "|".join(_FORGET_GATE_PARTS) + r")$")
_EXPERT_PART = re.compile(r"(?<=\.experts\.)(\d+)\.(" + "|".join(_EXPERT_SHARD) + r")$")


def module_spellings(prefix: str) -> tuple[str, ...]:
    """Every name of the module `prefix` (a tensor name without its last component) that the table above
    accepts for the same parameter, in both namings and under every root a checkpoint or a quantization
    config uses; `prefix` itself first. Quantization configs are resolved through this, so a config key
    written in either naming finds the layer (tests/models/test_kimi_model.py checks that every spelling
    maps to the same target)."""
    core = prefix
    roots: tuple[str, ...] = _CONFIG_ROOTS
    for root in _CONFIG_ROOTS[:-1]:
        if prefix.startswith(root):
            core = prefix[len(root) :]
            break
    if core == "lm_head" or core.startswith("lm_head."):
        roots = ("language_model.", "")
    cores = [core]
    swapped = _MOE_PART.sub(lambda m: "mlp" if m[1] == "block_sparse_moe" else "block_sparse_moe", core)
    cores.append(swapped)
    for c in list(cores):
        cores.append(_FORGET_PART.sub(lambda m: ("" if m[1] else "forget_gate.") + m[2], c))
        cores.append(
            _EXPERT_PART.sub(lambda m: f"{m[1]}." + (_EXPERT_NAMES.get(m[2]) or _EXPERT_SHARD[m[2]]), c)
        )
    out = [prefix]
    for c in cores:
        for root in roots:
            if root + c not in out:
                out.append(root + c)
    return tuple(out)


def map_checkpoint_name(name: str, model: KimiForCausalLM) -> list[Target] | tuple[Target, ...] | None:
    if _IGNORED.match(name):
        return IGNORE
    core = _strip_root(name)
    if core is None:
        return None
    if core.startswith("lm_head.") and model.lm_head is None:
        return IGNORE  # tie_word_embeddings: logits use embed_tokens; a saved copy of it is redundant
    core = _MOE_RENAME.sub("mlp", core)
    for pattern, rule in CHECKPOINT_TABLE:
        m = pattern.fullmatch(core)
        if m is not None:
            # a rule may decline (e.g. q_proj of an MLA layer under the KDA row): try the next one
            out = rule(m, model)
            if out is not None:
                return out
    return None
