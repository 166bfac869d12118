from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from k3run.config import ModelConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REAL = FIXTURES / "real_checkpoints"

# Moonshot's original Kimi Linear 48B-A3B config.json fields (kimi-architecture.md §1)
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "intermediate_size": 9216,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "rope_theta": 10000,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 2.446,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
}

K3_TEXT = {
    **{k: v for k, v in KIMI_LINEAR_48B.items() if k not in ("rope_theta", "head_dim")},
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 33792,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "mla_use_output_gate": True,
    "linear_attn_config": {
        "full_attn_layers": [*range(4, 93, 4), 93],
        "kda_layers": [i for i in range(1, 93) if i % 4],
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "routed_scaling_factor": 1.0,
    "attn_res_block_size": 12,
}
K3 = {"model_type": "kimi_k3", "text_config": K3_TEXT, "vision_config": {"depth": 27}}


def test_kimi_linear_original_config():
    c = ModelConfig.from_hf(KIMI_LINEAR_48B)
    # 1-indexed lists: layer 3 (0-indexed) is the first MLA layer, layer 26 the last
    assert [i for i in range(27) if not c.is_kda_layer(i)] == [3, 7, 11, 15, 19, 23, 26]
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 27))
    assert c.kda_proj_size == 4096 and c.conv_kernel_size == 4
    assert c.gate_lower_bound is None and not c.use_full_rank_gate and c.q_lora_rank is None
    assert c.hidden_act == "silu" and c.situ_beta is None
    assert c.expert_hidden_size == 2304 and c.shared_intermediate_size == 1024
    assert not c.uses_attn_res and c.routed_scaling_factor == 2.446 and c.qk_head_dim == 192


def test_kimi_k3_config():
    c = ModelConfig.from_hf(K3)
    assert c.is_k3 and c.num_hidden_layers == 93
    mla = [i for i in range(93) if not c.is_kda_layer(i)]
    assert mla == [*range(3, 92, 4), 92] and len(mla) == 24
    assert sum(c.layer_is_moe) == 92 and not c.is_moe_layer(0)
    assert (c.hidden_act, c.situ_beta, c.situ_linear_beta) == ("situ", 4.0, 25.0)
    assert c.use_full_rank_gate and c.gate_lower_bound == -5.0 and c.mla_use_output_gate
    assert c.q_lora_rank == 1536 and c.expert_hidden_size == 3584 and c.latent_moe_use_norm
    assert c.attn_res_block_size == 12 and c.shared_intermediate_size == 6144


@pytest.mark.parametrize("name", ["nvidia-Kimi-K3-NVFP4", "moonshotai-Kimi-K3"])
def test_published_k3_configs(name):
    """The config.json files of the published K3 checkpoints (fixtures/real_checkpoints): the gate fields
    sit in text_config.linear_attn_config and must reach the model."""
    hf = json.loads((REAL / f"{name}.config.json").read_text())
    c = ModelConfig.from_hf(hf)
    assert c.is_k3 and c.num_hidden_layers == 93 and c.num_experts == 896
    assert c.use_full_rank_gate and c.gate_lower_bound == -5.0
    assert [i for i in range(93) if not c.is_kda_layer(i)] == [*range(3, 92, 4), 92]
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (96, 128, 4)
    assert sum(c.layer_is_moe) == 92 and not c.is_moe_layer(0) and c.num_experts_per_token == 16
    assert c.expert_hidden_size == 3584 and c.shared_intermediate_size == 6144 and c.q_lora_rank == 1536
    assert c.attn_res_block_size == 12 and c.mla_use_output_gate and c.latent_moe_use_norm
    # the same values spelled at the text-config top level as well: accepted when they agree
    text = hf["text_config"]
    both = _with(hf, text | {"use_full_rank_gate": True, "gate_lower_bound": -5}, "text_config")
    assert ModelConfig.from_hf(both) == c
    for field, value, shown in (
        ("use_full_rank_gate", False, "True != False"),
        ("gate_lower_bound", -2.0, "-5.0 != -2.0"),
    ):
        bad = _with(hf, text | {field: value}, "text_config")
        with pytest.raises(
            ValueError, match=rf"'linear_attn_config.{field}' and '{field}' contradict each other: {shown}"
        ):
            ModelConfig.from_hf(bad)


def test_transformers5_and_modelopt_fixture_configs():
    """transformers 5.24 writes layer_types / mlp_layer_types / linear_* next to the original fields."""
    for name in ("kimi_linear_bf16", "kimi_linear_nvfp4"):
        hf = json.loads((FIXTURES / name / "config.json").read_text())
        c = ModelConfig.from_hf(hf)
        assert c.layer_is_kda == (True, True, True, False)
        assert c.layer_is_moe == (False, True, True, True)
        assert (c.kda_num_heads, c.kda_head_dim, c.num_experts_per_token) == (2, 32, 2)
    # the transformers-5 spelling alone (no linear_attn_config, no first_k_dense_replace)
    hf5 = {k: v for k, v in hf.items() if k not in ("linear_attn_config", "first_k_dense_replace")}
    assert ModelConfig.from_hf(hf5) == c
    # transformers attribute aliases
    alias = {k: v for k, v in hf5.items() if k not in ("num_experts_per_token", "num_experts")}
    alias |= {"num_experts_per_tok": 2, "num_local_experts": 4}
    assert ModelConfig.from_hf(alias) == c


def _without(cfg: dict, *path: str) -> dict:
    out = copy.deepcopy(cfg)
    d = out
    for p in path[:-1]:
        d = d[p]
    del d[path[-1]]
    return out


def _with(cfg: dict, value: object, *path: str) -> dict:
    out = copy.deepcopy(cfg)
    d = out
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_without(KIMI_LINEAR_48B, "hidden_size"), r"'hidden_size': expected .* got None"),
        (_without(KIMI_LINEAR_48B, "first_k_dense_replace"), r"'first_k_dense_replace'"),
        (_without(KIMI_LINEAR_48B, "linear_attn_config", "num_heads"), r"'linear_num_heads'"),
        (_with(KIMI_LINEAR_48B, [1, 2], "linear_attn_config", "kda_layers"), r"every layer in kda_layers"),
        (_with(KIMI_LINEAR_48B, [0, 4], "linear_attn_config", "full_attn_layers"), r"1\.\.27 \(1-indexed\)"),
        (
            _with(KIMI_LINEAR_48B, 64, "linear_num_heads"),
            r"'linear_attn_config.num_heads' and 'linear_num_heads'",
        ),
        (_with(KIMI_LINEAR_48B, ["linear_attention"] * 27, "layer_types"), r"'layer_types' contradict"),
        (_with(KIMI_LINEAR_48B, ["sparse"] * 27, "mlp_layer_types"), r"'mlp_layer_types' contradict"),
        (
            _with(KIMI_LINEAR_48B, 4, "num_experts_per_tok"),
            r"'num_experts_per_token' and 'num_experts_per_tok'",
        ),
        (_with(KIMI_LINEAR_48B, "gelu", "hidden_act"), r"'hidden_act': expected 'silu' or 'situ'"),
        (_with(KIMI_LINEAR_48B, "softmax", "moe_router_activation_func"), r"moe_router_activation_func"),
        (_with(KIMI_LINEAR_48B, 5.0, "gate_lower_bound"), r"'gate_lower_bound': expected a negative"),
        (_with(KIMI_LINEAR_48B, False, "mla_use_nope"), r"'mla_use_nope'"),
        (_with(KIMI_LINEAR_48B, "deepseek_v3", "model_type"), r"'model_type': expected"),
        (_with(KIMI_LINEAR_48B, "1e-5", "rms_norm_eps"), r"'rms_norm_eps': expected a number, got '1e-5'"),
        (_without(K3_TEXT | {"model_type": "kimi_linear"}, "activation_situ_beta"), r"activation_situ_beta"),
        ({"model_type": "kimi_k3"}, r"'text_config'"),
    ],
)
def test_bad_configs_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_config_is_frozen():
    c = ModelConfig.from_hf(KIMI_LINEAR_48B)
    with pytest.raises(AttributeError):
        c.hidden_size = 1  # type: ignore[misc]
