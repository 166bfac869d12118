"""Tiny random Kimi Linear and K3 configs and bf16 checkpoints under Moonshot's original names, shared by
the model and engine tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3run.formats import dequantize_fp8_block, dequantize_nvfp4

D, VOCAB = 64, 96

KIMI_LINEAR = {
    "model_type": "kimi_linear",
    "vocab_size": VOCAB,
    "hidden_size": D,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "intermediate_size": 96,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
    "num_attention_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "num_expert_group": 2,  # grouped top-k active (the released models use 1 group)
    "topk_group": 1,
    "dtype": "float32",
}

K3_TEXT = {
    **{k: v for k, v in KIMI_LINEAR.items() if k != "dtype"},
    "num_hidden_layers": 5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4, 5],  # every 4th and the last, as in K3
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
    "use_full_rank_gate": True,
    "gate_lower_bound": -5.0,
    "q_lora_rank": 32,
    "mla_use_output_gate": True,
    "num_experts_per_token": 3,
    "num_shared_experts": 2,
    "moe_intermediate_size": 16,
    "routed_expert_hidden_size": 32,
    "latent_moe_use_norm": True,
    "routed_scaling_factor": 1.0,
    "num_expert_group": 1,
    "attn_res_block_size": 2,  # 5 layers: blocks close at 0, 2, 4 -> 3 closed blocks + the open one
}
K3 = {"model_type": "kimi_k3", "text_config": K3_TEXT, "dtype": "float32"}


def random_linear(g: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return (torch.randn(out, inp, generator=g) / math.sqrt(inp)).to(torch.bfloat16)


def random_norm(g: torch.Generator, n: int) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(n, generator=g)).to(torch.bfloat16)


def random_checkpoint(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random bf16 weights under Moonshot's original names (K3: under language_model.)."""
    c = hf.get("text_config", hf)
    D, VOCAB = c["hidden_size"], c["vocab_size"]  # the module defaults are the tiny configs; any widths here
    k3 = hf["model_type"] == "kimi_k3"
    root = "language_model.model." if k3 else "model."
    g = torch.Generator().manual_seed(seed)
    lin = c["linear_attn_config"]
    H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    P = H * K
    t: dict[str, torch.Tensor] = {
        f"{root}embed_tokens.weight": torch.randn(VOCAB, D, generator=g).to(torch.bfloat16),
        f"{root}norm.weight": random_norm(g, D),
        ("language_model." if k3 else "") + "lm_head.weight": random_linear(g, VOCAB, D),
    }
    if k3:
        t[f"{root}output_attn_res_norm.weight"] = random_norm(g, D)
        t[f"{root}output_attn_res_proj.weight"] = random_linear(g, 1, D)
    for i in range(c["num_hidden_layers"]):
        p = f"{root}layers.{i}."
        t[p + "input_layernorm.weight"] = random_norm(g, D)
        t[p + "post_attention_layernorm.weight"] = random_norm(g, D)
        if k3:
            for site in ("self_attention_res", "mlp_res"):
                t[p + f"{site}_norm.weight"] = random_norm(g, D)
                t[p + f"{site}_proj.weight"] = random_linear(g, 1, D)
        a = p + "self_attn."
        if i + 1 in lin["kda_layers"]:
            for n in ("q", "k", "v"):
                t[a + f"{n}_proj.weight"] = random_linear(g, P, D)
                t[a + f"{n}_conv1d.weight"] = (0.5 * torch.randn(P, 1, W, generator=g)).to(torch.bfloat16)
            t[a + "f_a_proj.weight"] = random_linear(g, K, D)
            t[a + "f_b_proj.weight"] = random_linear(g, P, K)
            t[a + "b_proj.weight"] = random_linear(g, H, D)
            a_log = torch.empty(H).uniform_(1, 16, generator=g).log().to(torch.bfloat16)
            t[a + "A_log"] = a_log if k3 else a_log.view(1, 1, H, 1)  # each model's published shape
            t[a + "dt_bias"] = 0.5 * torch.randn(P, generator=g)
            t[a + "o_norm.weight"] = random_norm(g, K)
            t[a + "o_proj.weight"] = random_linear(g, D, P)
            if c.get("use_full_rank_gate"):
                t[a + "g_proj.weight"] = random_linear(g, P, D)
            else:
                t[a + "g_a_proj.weight"] = random_linear(g, K, D)
                t[a + "g_b_proj.weight"] = random_linear(g, P, K)
        else:
            nh, dn, dr, dv, L = (
                c[k]
                for k in (
                    "num_attention_heads",
                    "qk_nope_head_dim",
                    "qk_rope_head_dim",
                    "v_head_dim",
                    "kv_lora_rank",
                )
            )
            if c["q_lora_rank"]:
                t[a + "q_a_proj.weight"] = random_linear(g, c["q_lora_rank"], D)
                t[a + "q_a_layernorm.weight"] = random_norm(g, c["q_lora_rank"])
                t[a + "q_b_proj.weight"] = random_linear(g, nh * (dn + dr), c["q_lora_rank"])
            else:
                t[a + "q_proj.weight"] = random_linear(g, nh * (dn + dr), D)
            t[a + "kv_a_proj_with_mqa.weight"] = random_linear(g, L + dr, D)
            t[a + "kv_a_layernorm.weight"] = random_norm(g, L)
            t[a + "kv_b_proj.weight"] = random_linear(g, nh * (dn + dv), L)
            t[a + "o_proj.weight"] = random_linear(g, D, nh * dv)
            if c.get("mla_use_output_gate"):
                t[a + "g_proj.weight"] = random_linear(g, nh * dv, D)
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = random_linear(g, inter, D)
            t[p + "mlp.up_proj.weight"] = random_linear(g, inter, D)
            t[p + "mlp.down_proj.weight"] = random_linear(g, D, inter)
            continue
        m = p + "block_sparse_moe."
        E, inter = c["num_experts"], c["moe_intermediate_size"]
        de = c.get("routed_expert_hidden_size") or D
        t[m + "gate.weight"] = torch.randn(E, D, generator=g) / math.sqrt(D)
        t[m + "gate.e_score_correction_bias"] = 0.1 * torch.randn(E, generator=g)
        for e in range(E):
            t[m + f"experts.{e}.w1.weight"] = random_linear(g, inter, de)
            t[m + f"experts.{e}.w3.weight"] = random_linear(g, inter, de)
            t[m + f"experts.{e}.w2.weight"] = random_linear(g, de, inter)
        si = inter * c["num_shared_experts"]
        t[m + "shared_experts.gate_proj.weight"] = random_linear(g, si, D)
        t[m + "shared_experts.up_proj.weight"] = random_linear(g, si, D)
        t[m + "shared_experts.down_proj.weight"] = random_linear(g, D, si)
        if c.get("routed_expert_hidden_size"):
            t[m + "routed_expert_down_proj.weight"] = random_linear(g, de, D)
            t[m + "routed_expert_up_proj.weight"] = random_linear(g, D, de)
            t[m + "routed_expert_norm.weight"] = random_norm(g, de)
    return t


def write_checkpoint(directory: Path, hf: dict, seed: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(random_checkpoint(hf, seed), str(directory / "model.safetensors"))
    return directory


def write_dequantized_copy(src: Path, dst: Path) -> None:
    """A ModelOpt export with every NVFP4 (uint8) and FP8_PB_WO (e4m3) weight replaced by its fp32
    dequantization, the scale tensors dropped and no quantization config: same tensor names otherwise."""
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind == "weight" and t.dtype == torch.uint8:
            scale, scale_2 = tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_scale_2"]
            out[name] = dequantize_nvfp4(t, scale, scale_2)
        elif kind == "weight" and t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8_block(t, tensors[f"{base}.weight_scale"])
        elif kind not in ("weight_scale", "weight_scale_2", "input_scale"):
            out[name] = t.float()
    hf = json.loads((src / "config.json").read_text())
    del hf["quantization_config"]
    hf["dtype"] = "float32"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(hf))
    save_file(out, str(dst / "model.safetensors"))
