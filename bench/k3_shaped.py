"""A K3-shaped model with random weights, quantized as the k3-mixed recipe quantizes (routed experts NVFP4,
attention projections FP8_PB_WO, the rest bf16), built straight in memory (no checkpoint on disk): for timing
decode steps at K3's real layer shapes on one GPU.

    model = random_k3_model(layers=4, experts=128, device="cuda")

Layers follow K3's pattern (KDA, KDA, KDA, MLA, ...) and every layer is a latent-MoE layer (K3's one dense
layer 0 is left out, so a step's time per layer is what K3's 92 MoE layers cost). `experts` stands in for
the experts one expert-parallel rank holds (K3: 896 over the EP group); each token still picks
`top_k` = 16 of them. Values are random with sane magnitudes (unit-RMS activations), so numbers mean
nothing; the shapes, dtypes, kernels and bytes read are K3's.
"""

from __future__ import annotations

import math

import torch

from k3run.config import ModelConfig
from k3run.distributed import NO_TP, TPInfo
from k3run.loader import PostLoad
from k3run.models.kimi import KimiForCausalLM
from k3run.quant.algo import QuantAlgo
from k3run.quant.export import quant_configs, recipe_algo
from k3run.quant.modelopt import load_quant_config

K3_DIMS = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_heads": 96,  # KDA and MLA
    "q_lora_rank": 1536,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
    "top_k": 16,
}
_KDA_PROJ = ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj")
_MLA_PROJ = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")


def k3_text_config(layers: int, experts: int, dims: dict | None = None) -> dict:
    d = K3_DIMS | (dims or {})
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    return {
        "model_type": "kimi_linear",
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 4 * d["hidden_size"],  # unused: no dense layer
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "full_attn_layers": full,
            "num_heads": d["num_heads"],
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
        "num_attention_heads": d["num_heads"],
        "num_key_value_heads": d["num_heads"],
        "q_lora_rank": d["q_lora_rank"],
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": experts,
        "num_experts_per_token": d["top_k"],
        "num_shared_experts": 2,
        "moe_intermediate_size": d["moe_intermediate_size"],
        "routed_expert_hidden_size": d["routed_expert_hidden_size"],
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "attn_res_block_size": 12,
        "max_position_embeddings": 1048576,
    }


def k3_mixed_quant_config(text: dict) -> dict:
    """config.json's quantization_config for the k3-mixed recipe over this model's linear layers."""
    full = set(text["linear_attn_config"]["full_attn_layers"])
    quantized: dict[str, QuantAlgo] = {}
    for i in range(text["num_hidden_layers"]):
        base = f"language_model.model.layers.{i}"
        projs = _MLA_PROJ if i + 1 in full else _KDA_PROJ
        prefixes = [f"{base}.self_attn.{p}" for p in projs]
        prefixes += [
            f"{base}.block_sparse_moe.experts.{e}.{w}"
            for e in range(text["num_experts"])
            for w in ("w1", "w2", "w3")
        ]
        for p in prefixes:
            algo = recipe_algo("k3-mixed", p)
            if algo is not QuantAlgo.NONE:
                quantized[p] = algo
    return quant_configs("k3-mixed", quantized, [])[1]


@torch.no_grad()
def _fill(name: str, p: torch.Tensor, gen: torch.Generator, hidden: int) -> None:
    last = name.rpartition(".")[2]
    if p.dtype == torch.uint8:  # packed E2M1 pairs: every byte is a valid pair
        p.copy_(torch.randint(0, 256, p.shape, generator=gen, dtype=torch.uint8, device=p.device))
    elif p.dtype == torch.float8_e4m3fn:
        if "scale" in last:  # NVFP4 group scales
            p.fill_(1.0)
        else:  # FP8_PB_WO weights; their fp32 block scales below give rows of RMS ~1/sqrt(K)
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device).clamp(-8, 8).to(p.dtype))
    elif last.endswith("weight_scale_2"):  # NVFP4 global scales: E2M1 codes have RMS ~3.2
        p.fill_(1.0 / (3.2 * math.sqrt(hidden)))
    elif last.endswith("weight_scale"):  # FP8_PB_WO block scales
        p.fill_(1.0 / math.sqrt(hidden))
    elif last.endswith("input_scale") or "norm" in name:
        p.fill_(1.0)
    elif last in ("A_log", "dt_bias", "e_score_correction_bias", "proj_weight") or last.endswith("bias"):
        p.zero_()
    elif last == "conv_weight":
        p.fill_(0.25)
    else:  # bf16 / fp32 matrices: rows of RMS 1/sqrt(K)
        p.copy_((torch.randn(p.shape, generator=gen, device=p.device) / math.sqrt(p.shape[-1])).to(p.dtype))


def kimi_linear_48b_config(layers: int | None = None, experts: int | None = None) -> dict:
    """The published config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (bench/configs/), optionally cut
    to its first `layers` layers (KDA / MLA pattern kept) and `experts` experts, with the ModelOpt NVFP4
    quantization_config of an all-NVFP4 export (`quant_configs("nvfp4", ...)`: every linear but the
    output head, the embeddings and the routers)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parent / "configs" / "kimi_linear_48b_a3b.json").read_text())
    if layers is not None:
        lac = cfg["linear_attn_config"]
        lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
        lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
        cfg["num_hidden_layers"] = layers
    if experts is not None:
        cfg["num_experts"] = experts
    cfg["quantization_config"] = quant_configs("nvfp4", {}, ["lm_head"])[1]
    return cfg


def random_model(
    hf: dict, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
    tp: TPInfo = NO_TP,
) -> KimiForCausalLM:  # fmt: skip
    """Any Kimi config.json dict (its quantization_config included) as a model with random weights filled
    as random_k3_model fills them, post-load processing done."""
    cfg = ModelConfig.from_hf(hf)
    qcfg = load_quant_config(hf)
    with torch.device(device):
        model = KimiForCausalLM(cfg, qcfg=qcfg, tp=tp, params_dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        _fill(name, p, gen, cfg.hidden_size)
    for module in reversed(list(model.modules())):
        if isinstance(module, PostLoad):
            module.process_after_loading()
    return model.eval()


def random_k3_model(
    layers: int = 4,
    experts: int = 128,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    dims: dict | None = None,
    seed: int = 0,
    tp: TPInfo = NO_TP,
) -> KimiForCausalLM:
    """The model on `device`; with `tp` (an initialised group) this rank's shard. Every rank draws the same
    sequence (the shards have equal shapes), so the replicated parameters (norms, router)
    agree across ranks."""
    text = k3_text_config(layers, experts, dims)
    cfg = ModelConfig.from_hf({"model_type": "kimi_k3", "text_config": text})
    qcfg = load_quant_config({"quantization_config": k3_mixed_quant_config(text)})
    with torch.device(device):
        model = KimiForCausalLM(cfg, qcfg=qcfg, tp=tp, params_dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        _fill(name, p, gen, text["hidden_size"])
    for module in reversed(list(model.modules())):  # as load_checkpoint does: children first
        if isinstance(module, PostLoad):
            module.process_after_loading()
    return model.eval()
