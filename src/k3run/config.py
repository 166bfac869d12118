"""Model configuration for Kimi Linear and Kimi K3 text decoders.

`ModelConfig.from_hf(config_dict)` accepts three spellings a user meets:
- Moonshot's original `config.json` (`model_type: kimi_linear`, `linear_attn_config` with 1-indexed
  `kda_layers` / `full_attn_layers` and, for K3, `use_full_rank_gate` / `gate_lower_bound`, `num_experts`,
  `first_k_dense_replace`, ...);
- the form transformers >= 5.24 writes on save and ModelOpt writes on export (`layer_types`,
  `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, ...);
- a `kimi_k3` wrapper whose text model sits in `text_config` (vision keys are ignored).
A field that is required but missing, has the wrong type, or is given twice with different values raises
ValueError naming the field, the expected and the actual value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KDA, _MLA = "linear_attention", "full_attention"
_DENSE, _SPARSE = "dense", "sparse"
_MISSING = object()


def _fail(field: str, expected: str, actual: Any) -> ValueError:
    return ValueError(f"config field {field!r}: expected {expected}, got {actual!r}")


def _pick(cfg: Mapping[str, Any], names: tuple[str, ...], default: Any = _MISSING) -> Any:
    """The value of the first of `names` present; every other present alias must agree."""
    found = [(n, cfg[n]) for n in names if n in cfg and cfg[n] is not None]
    if not found:
        if default is _MISSING:
            raise _fail(names[0], "a value (missing from config.json)", None)
        return default
    name0, val0 = found[0]
    for name, val in found[1:]:
        if val != val0:
            raise ValueError(
                f"config fields {name0!r} and {name!r} contradict each other: {val0!r} != {val!r}"
            )
    return val0


def _agree(a: Mapping[str, Any], a_name: str, b: Mapping[str, Any], b_name: str) -> Any:
    va, vb = a.get(a_name), b.get(b_name)
    if va is not None and vb is not None and va != vb:
        raise ValueError(
            f"config fields 'linear_attn_config.{a_name}' and {b_name!r} contradict each other: "
            f"{va!r} != {vb!r}"
        )
    return va if va is not None else vb


def _int(cfg: Mapping[str, Any], *names: str, default: Any = _MISSING, minimum: int = 1) -> Any:
    val = _pick(cfg, names, default)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise _fail(names[0], f"an integer >= {minimum}", val)
    return val


def _float(cfg: Mapping[str, Any], *names: str, default: Any = _MISSING) -> Any:
    val = _pick(cfg, names, default)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, int | float):
        raise _fail(names[0], "a number", val)
    return float(val)


def _bool(cfg: Mapping[str, Any], *names: str, default: Any = _MISSING) -> bool:
    val = _pick(cfg, names, default)
    if not isinstance(val, bool):
        raise _fail(names[0], "true or false", val)
    return val


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Kimi Linear / K3 text decoder that k3run uses.

    Layer lists are stored 0-indexed as per-layer tuples; `kda_layers` / `full_attn_layers` in Moonshot's
    config are 1-indexed (0-indexed layer i is KDA iff i + 1 is in kda_layers).
    """

    model_type: str  # "kimi_linear" or "kimi_k3" (the outer wrapper's type)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_is_kda: tuple[bool, ...]  # [num_hidden_layers]
    layer_is_moe: tuple[bool, ...]  # [num_hidden_layers]
    hidden_act: str  # "silu" or "situ"
    situ_beta: float | None
    situ_linear_beta: float | None
    intermediate_size: int  # dense MLP
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    use_full_rank_gate: bool  # K3: g_proj hidden -> P; Kimi Linear: g_b_proj(g_a_proj(x))
    gate_lower_bound: float | None  # K3: -5.0 (sigmoid gate); None: softplus gate
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # MoE
    num_experts: int | None
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: int | None  # K3 latent MoE width; None: experts see the full hidden
    latent_moe_use_norm: bool
    # K3 block attention residuals; None: plain pre-norm residual stream
    attn_res_block_size: int | None

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Both checkpoint spellings (the original and transformers-5 field names); every field checked, the
        first bad one named with its expected and actual value."""
        outer_type, cfg = _text_config(config)
        n_layers = _int(cfg, "num_hidden_layers")
        layer_is_kda = _parse_layer_types(cfg, n_layers)
        num_experts = _int(cfg, "num_experts", "num_local_experts", default=None)
        layer_is_moe = _parse_mlp_types(cfg, n_layers, num_experts)
        activation = _activation_fields(cfg)
        kda = _kda_fields(cfg, layer_is_kda)
        moe = _moe_fields(cfg, num_experts, any(layer_is_moe))
        attn_res = _int(cfg, "attn_res_block_size", default=None)
        mla = _mla_fields(cfg, any_mla=not all(layer_is_kda))
        return cls(
            model_type=outer_type,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=_int(cfg, "hidden_size"),
            num_hidden_layers=n_layers,
            rms_norm_eps=_float(cfg, "rms_norm_eps"),
            tie_word_embeddings=_bool(
                cfg, "tie_word_embeddings", default=bool(config.get("tie_word_embeddings", False))
            ),
            layer_is_kda=layer_is_kda,
            layer_is_moe=layer_is_moe,
            **activation,
            intermediate_size=_int(
                cfg, "intermediate_size", default=_MISSING if not all(layer_is_moe) else 0, minimum=0
            ),
            **kda,
            **mla,
            num_experts=num_experts,
            **moe,
            attn_res_block_size=attn_res,
        )

    def is_kda_layer(self, i: int) -> bool:
        return self.layer_is_kda[i]

    def is_moe_layer(self, i: int) -> bool:
        return self.layer_is_moe[i]

    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def kda_proj_size(self) -> int:
        """P = H * K of a KDA layer (global, before TP)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_hidden_size(self) -> int:
        """Input/output width of each routed expert: the latent width for K3, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts


def _type_list_flags(
    field: str, types: Any, n_layers: int, allowed: tuple[str, str], *, flagged: str
) -> tuple[bool, ...]:
    """A per-layer list of type names, each one of `allowed`, as one flag per layer (entry == `flagged`)."""
    if not isinstance(types, list) or len(types) != n_layers:
        raise _fail(field, f"a list of {n_layers} entries", types)
    bad = [t for t in types if t not in allowed]
    if bad:
        raise _fail(field, f"entries {allowed[0]!r} or {allowed[1]!r}", bad)
    return tuple(t == flagged for t in types)


def _kda_layer_lists(lin: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    """Per-layer KDA flag from linear_attn_config's kda_layers / full_attn_layers (1-indexed, disjoint,
    covering every layer)."""
    kda = lin.get("kda_layers")
    full = lin.get("full_attn_layers")
    for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
        if not isinstance(lst, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lst):
            raise _fail(f"linear_attn_config.{name}", "a list of 1-indexed layer numbers", lst)
        bad = [x for x in lst if not 1 <= x <= n_layers]
        if bad:
            raise _fail(f"linear_attn_config.{name}", f"layer numbers in 1..{n_layers} (1-indexed)", bad)
    assert isinstance(kda, list) and isinstance(full, list)
    both = sorted(set(kda) & set(full))
    if both:
        raise _fail("linear_attn_config.kda_layers", "no layer also in full_attn_layers", both)
    missing = sorted(set(range(1, n_layers + 1)) - set(kda) - set(full))
    if missing:
        raise _fail("linear_attn_config.kda_layers", "every layer in kda_layers or full_attn_layers", missing)
    return tuple((i + 1) in kda for i in range(n_layers))


def _parse_layer_types(cfg: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    """Per-layer KDA flag from `linear_attn_config` (1-indexed lists) and/or `layer_types` (must agree)."""
    from_lists: tuple[bool, ...] | None = None
    lin = cfg.get("linear_attn_config")
    if isinstance(lin, Mapping) and ("kda_layers" in lin or "full_attn_layers" in lin):
        from_lists = _kda_layer_lists(lin, n_layers)

    from_types: tuple[bool, ...] | None = None
    types = cfg.get("layer_types")
    if types is not None:
        from_types = _type_list_flags("layer_types", types, n_layers, (_KDA, _MLA), flagged=_KDA)

    if from_lists is None and from_types is None:
        raise _fail("linear_attn_config.kda_layers", "kda_layers/full_attn_layers or layer_types", None)
    if from_lists is not None and from_types is not None and from_lists != from_types:
        raise ValueError(
            "config fields 'linear_attn_config.kda_layers' and 'layer_types' contradict each other: "
            f"{[i + 1 for i, k in enumerate(from_lists) if k]} (1-indexed) vs "
            f"{[i + 1 for i, k in enumerate(from_types) if k]}"
        )
    return from_lists if from_lists is not None else from_types  # type: ignore[return-value]


def _parse_mlp_types(cfg: Mapping[str, Any], n_layers: int, num_experts: int | None) -> tuple[bool, ...]:
    """Per-layer MoE flag from `mlp_layer_types` and/or first_k_dense_replace / moe_layer_freq."""
    from_rule: tuple[bool, ...] | None = None
    types = cfg.get("mlp_layer_types")
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg or types is None:
        # Without mlp_layer_types the dense prefix must be stated; it has no safe default.
        need = _MISSING if types is None and num_experts is not None else 0
        first_dense = _int(cfg, "first_k_dense_replace", default=need, minimum=0)
        freq = _int(cfg, "moe_layer_freq", default=1)
        from_rule = tuple(
            num_experts is not None and i >= first_dense and i % freq == 0 for i in range(n_layers)
        )

    from_types: tuple[bool, ...] | None = None
    if types is not None:
        from_types = _type_list_flags("mlp_layer_types", types, n_layers, (_DENSE, _SPARSE), flagged=_SPARSE)
        if any(from_types) and num_experts is None:
            raise _fail("num_experts", "an expert count (mlp_layer_types has sparse layers)", None)

    if from_rule is not None and from_types is not None and from_rule != from_types:
        raise ValueError(
            "config fields 'first_k_dense_replace'/'moe_layer_freq' and 'mlp_layer_types' contradict each "
            f"other: MoE layers {[i for i, m in enumerate(from_rule) if m]} vs "
            f"{[i for i, m in enumerate(from_types) if m]} (0-indexed)"
        )
    return from_types if from_types is not None else from_rule  # type: ignore[return-value]


def _text_config(config: Any) -> tuple[str, Mapping[str, Any]]:
    """(model_type, the text model's fields): kimi_linear at the top level, or kimi_k3's text_config."""
    if not isinstance(config, Mapping):
        raise _fail("<config>", "a JSON object", type(config).__name__)
    outer_type = config.get("model_type")
    if outer_type == "kimi_k3":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise _fail("text_config", "an object holding the kimi_linear text model", text)
        inner_type = text.get("model_type", "kimi_linear")
        if inner_type != "kimi_linear":
            raise _fail("text_config.model_type", "'kimi_linear'", inner_type)
        return outer_type, text
    if outer_type == "kimi_linear":
        return outer_type, config
    raise _fail("model_type", "'kimi_linear' or 'kimi_k3'", outer_type)


def _activation_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """hidden_act (SiLU or K3's SiTU) and SiTU's two betas."""
    hidden_act = _pick(cfg, ("hidden_act",), "silu")
    if hidden_act not in ("silu", "situ"):
        raise _fail("hidden_act", "'silu' or 'situ'", hidden_act)
    situ_beta = situ_linear_beta = None
    if hidden_act == "situ":
        situ_beta = _float(cfg, "activation_situ_beta")
        situ_linear_beta = _float(cfg, "activation_situ_linear_beta", default=None)
        if situ_beta <= 0:
            raise _fail("activation_situ_beta", "a positive number", situ_beta)
        if situ_linear_beta is not None and situ_linear_beta <= 0:
            raise _fail("activation_situ_linear_beta", "a positive number or null", situ_linear_beta)
    return {"hidden_act": hidden_act, "situ_beta": situ_beta, "situ_linear_beta": situ_linear_beta}


def _kda_fields(cfg: Mapping[str, Any], layer_is_kda: list[bool]) -> dict[str, Any]:
    """The KDA geometry and K3's gate fields (required only when a layer is KDA)."""
    lin = cfg.get("linear_attn_config") or {}
    if not isinstance(lin, Mapping):
        raise _fail("linear_attn_config", "an object", lin)
    # transformers keeps both spellings of the KDA geometry: they must agree where both are written.
    geometry = {
        "linear_num_heads": _agree(lin, "num_heads", cfg, "linear_num_heads"),
        "linear_head_dim": _agree(lin, "head_dim", cfg, "linear_head_dim"),
        "linear_conv_kernel_dim": _agree(lin, "short_conv_kernel_size", cfg, "linear_conv_kernel_dim"),
    }
    kda_default = _MISSING if any(layer_is_kda) else None
    kda_num_heads = _int(geometry, "linear_num_heads", default=kda_default)
    kda_head_dim = _int(geometry, "linear_head_dim", default=kda_default)
    conv_kernel_size = _int(geometry, "linear_conv_kernel_dim", default=4)
    # K3 nests the gate fields in linear_attn_config (the official code reads them there); a top-level
    # spelling is accepted too, and both must agree where both are written
    gate = {
        "gate_lower_bound": _agree(lin, "gate_lower_bound", cfg, "gate_lower_bound"),
        "use_full_rank_gate": _agree(lin, "use_full_rank_gate", cfg, "use_full_rank_gate"),
    }
    gate_lower_bound = _float(gate, "gate_lower_bound", default=None)
    if gate_lower_bound is not None and gate_lower_bound >= 0:
        raise _fail("gate_lower_bound", "a negative number or null", gate_lower_bound)
    return {
        "kda_num_heads": kda_num_heads or 0,
        "kda_head_dim": kda_head_dim or 0,
        "conv_kernel_size": conv_kernel_size,
        "use_full_rank_gate": _bool(gate, "use_full_rank_gate", default=False),
        "gate_lower_bound": gate_lower_bound,
    }


def _moe_fields(cfg: Mapping[str, Any], num_experts: int | None, any_moe: bool) -> dict[str, Any]:
    """Routing (sigmoid router, top-k, expert groups), shared experts, K3's latent MoE width."""
    routed_hidden = _int(cfg, "routed_expert_hidden_size", default=None)
    moe_default = _MISSING if any_moe else None
    num_expert_group = _int(cfg, "num_expert_group", "n_group", default=1)
    topk_group = _int(cfg, "topk_group", default=1)
    if topk_group > num_expert_group:
        raise _fail("topk_group", f"<= num_expert_group ({num_expert_group})", topk_group)
    router_act = _pick(cfg, ("moe_router_activation_func",), "sigmoid")
    if router_act != "sigmoid":
        raise _fail("moe_router_activation_func", "'sigmoid' (the only router Kimi models use)", router_act)
    top_k = _int(cfg, "num_experts_per_token", "num_experts_per_tok", default=moe_default)
    if num_experts is not None and top_k is not None and top_k > num_experts:
        raise _fail("num_experts_per_token", f"<= num_experts ({num_experts})", top_k)
    if num_experts is not None and num_experts % num_expert_group:
        raise _fail("num_expert_group", f"a divisor of num_experts ({num_experts})", num_expert_group)
    return {
        "num_experts_per_token": top_k or 0,
        "num_shared_experts": _int(cfg, "num_shared_experts", "n_shared_experts", default=0, minimum=0),
        "moe_intermediate_size": _int(cfg, "moe_intermediate_size", default=moe_default) or 0,
        "routed_scaling_factor": _float(cfg, "routed_scaling_factor", default=1.0),
        "moe_renormalize": _bool(cfg, "moe_renormalize", "norm_topk_prob", default=True),
        "num_expert_group": num_expert_group,
        "topk_group": topk_group,
        "routed_expert_hidden_size": routed_hidden,
        "latent_moe_use_norm": _bool(cfg, "latent_moe_use_norm", default=False),
    }


def _mla_fields(cfg: Mapping[str, Any], any_mla: bool) -> dict[str, Any]:
    """MLA's geometry (required only when a layer is MLA); Kimi's MLA is NoPE."""
    if _pick(cfg, ("mla_use_nope",), True) is not True:
        raise _fail("mla_use_nope", "true (Kimi MLA has no rotary embedding)", cfg.get("mla_use_nope"))
    mla_default = _MISSING if any_mla else None
    return {
        "num_attention_heads": _int(cfg, "num_attention_heads", default=mla_default) or 0,
        "q_lora_rank": _int(cfg, "q_lora_rank", default=None),
        "kv_lora_rank": _int(cfg, "kv_lora_rank", default=mla_default) or 0,
        "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim", default=mla_default) or 0,
        "qk_rope_head_dim": _int(cfg, "qk_rope_head_dim", default=mla_default) or 0,
        "v_head_dim": _int(cfg, "v_head_dim", default=mla_default) or 0,
        "mla_use_output_gate": _bool(cfg, "mla_use_output_gate", default=False),
    }
