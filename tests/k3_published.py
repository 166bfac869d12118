"""A reduced Kimi K3 written as the published checkpoints are: the tensor names, dtypes and shape rules of
moonshotai/Kimi-K3 (fixtures/real_checkpoints/moonshotai-Kimi-K3.layer1-header-rows.json) and their two
quantization configs, verbatim from fixtures/real_checkpoints:
- "mxfp4": moonshotai/Kimi-K3, routed experts compressed-tensors MXFP4 (weight_packed U8 + E8M0 U8
  weight_scale per 32), everything else BF16 with the F32 tensors the headers show;
- "nvfp4": nvidia/Kimi-K3-NVFP4, as its converter derives it from the MXFP4 one (the converter's cast with
  k_max shared by w1 and w3, input_scale 1.0), attention FP8_PB_WO (128x128 blocks, weight only);
- "bf16": the same model unquantized (the source `k3run quantize` takes).
Widths are cut so a CPU test takes seconds: the layer pattern (KDA, KDA, KDA, MLA; dense layer 0), head_dim
128, the MLA head dims, kv_lora_rank and the A_log padding are real; `DIMS` holds the rest.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3run.formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    mxfp4_k_max,
    mxfp4_to_nvfp4,
    pack_e2m1,
    quantize_fp8_block,
)

REAL = Path(__file__).resolve().parent / "fixtures" / "real_checkpoints"
BF, F32 = torch.bfloat16, torch.float32
LM = "language_model.model."

# real K3: hidden 7168, 96 KDA heads, 96 MLA heads, q_lora 1536, 896 experts top-16, expert width 3584,
# moe_intermediate 3072, dense intermediate 33792, vocab 163840, 93 layers, attn_res_block_size 12
DIMS = {
    "hidden_size": 256,
    "kda_heads": 4,  # A_log [128] then holds 4 values and 124 zeros; even, for TP = 2
    "head_dim": 128,
    "mla_heads": 2,
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 512,
    "num_experts": 8,
    "top_k": 2,
    "routed_expert_hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_shared_experts": 2,
    "vocab_size": 512,
    "attn_res_block_size": 2,
}
KDA_LAYERS, FULL_LAYERS = [1, 2, 3], [4]  # 1-indexed, the first four layers of K3
# the projections nvidia/Kimi-K3-NVFP4 stores FP8_PB_WO (modelopt-contracts.md §0b)
FP8_KDA = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj", "o_proj")
FP8_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")


def layer1_shapes(d: dict[str, int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer 1 (KDA + MoE) tensor -> (dtype, shape) by the published shape rules; with the real widths this
    is exactly the published header rows (tests check it)."""
    D, H, K = d["hidden_size"], d["kda_heads"], d["head_dim"]
    P, L, I_, E = H * K, d["routed_expert_hidden_size"], d["moe_intermediate_size"], d["num_experts"]
    S = I_ * d["num_shared_experts"]
    out = {
        "self_attention_res_norm.weight": ("BF16", (D,)),
        "self_attention_res_proj.weight": ("BF16", (1, D)),
        "input_layernorm.weight": ("BF16", (D,)),
        "self_attn.f_a_proj.weight": ("BF16", (K, D)),
        "self_attn.f_b_proj.weight": ("BF16", (P, K)),
        "self_attn.A_log": ("F32", (K,)),
        "self_attn.dt_bias": ("F32", (P,)),
        "self_attn.b_proj.weight": ("BF16", (H, D)),
        "self_attn.g_proj.weight": ("BF16", (P, D)),
        "self_attn.o_norm.weight": ("F32", (K,)),
        "self_attn.o_proj.weight": ("BF16", (D, P)),
        "mlp_res_norm.weight": ("BF16", (D,)),
        "mlp_res_proj.weight": ("BF16", (1, D)),
        "post_attention_layernorm.weight": ("BF16", (D,)),
        "block_sparse_moe.gate.weight": ("BF16", (E, D)),
        "block_sparse_moe.gate.e_score_correction_bias": ("F32", (E,)),
        "block_sparse_moe.routed_expert_down_proj.weight": ("BF16", (L, D)),
        "block_sparse_moe.routed_expert_norm.weight": ("BF16", (L,)),
        "block_sparse_moe.routed_expert_up_proj.weight": ("BF16", (D, L)),
        "block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", (S, D)),
        "block_sparse_moe.shared_experts.up_proj.weight": ("BF16", (S, D)),
        "block_sparse_moe.shared_experts.down_proj.weight": ("BF16", (D, S)),
    }
    for n in "qkv":
        out[f"self_attn.{n}_proj.weight"] = ("BF16", (P, D))
        out[f"self_attn.{n}_conv1d.weight"] = ("F32", (P, 1, 4))
    for w, (rows, k) in (("w1", (I_, L)), ("w2", (L, I_)), ("w3", (I_, L))):
        out[f"block_sparse_moe.experts.0.{w}.weight_packed"] = ("U8", (rows, k // 2))
        out[f"block_sparse_moe.experts.0.{w}.weight_scale"] = ("U8", (rows, k // 32))
    return out


def real_dims() -> dict[str, int]:
    text = json.loads((REAL / "moonshotai-Kimi-K3.config.json").read_text())["text_config"]
    lin = text["linear_attn_config"]
    return {
        "hidden_size": text["hidden_size"],
        "kda_heads": lin["num_heads"],
        "head_dim": lin["head_dim"],
        "routed_expert_hidden_size": text["routed_expert_hidden_size"],
        "moe_intermediate_size": text["moe_intermediate_size"],
        "num_experts": text["num_experts"],
        "num_shared_experts": text["num_shared_experts"],
    }


def config(kind: str) -> dict:
    """The published config.json of `kind` with the widths of DIMS (quantization_config verbatim)."""
    name = "moonshotai-Kimi-K3" if kind in ("mxfp4", "bf16") else "nvidia-Kimi-K3-NVFP4"
    hf = json.loads((REAL / f"{name}.config.json").read_text())
    t, d = hf["text_config"], DIMS
    t.update(
        hidden_size=d["hidden_size"],
        num_hidden_layers=len(KDA_LAYERS) + len(FULL_LAYERS),
        num_attention_heads=d["mla_heads"],
        num_key_value_heads=d["mla_heads"],
        q_lora_rank=d["q_lora_rank"],
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"],
        intermediate_size=d["intermediate_size"],
        num_experts=d["num_experts"],
        num_experts_per_token=d["top_k"],
        routed_expert_hidden_size=d["routed_expert_hidden_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_shared_experts=d["num_shared_experts"],
        vocab_size=d["vocab_size"],
        attn_res_block_size=d["attn_res_block_size"],
    )
    t["linear_attn_config"].update(
        kda_layers=KDA_LAYERS, full_attn_layers=FULL_LAYERS, num_heads=d["kda_heads"], head_dim=d["head_dim"]
    )
    if kind == "bf16":
        del t["quantization_config"]
    return hf


def _rand(g: torch.Generator, *shape: int, scale: float | None = None) -> torch.Tensor:
    fan_in = shape[-1]
    return torch.randn(*shape, generator=g) * (scale if scale is not None else fan_in**-0.5)


def bf16_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The unquantized reduced K3 (routed experts as BF16 .weight) under the published names and dtypes."""
    g = torch.Generator().manual_seed(seed)
    d = DIMS
    D, K = d["hidden_size"], d["head_dim"]
    shapes = layer1_shapes(d)

    def make(name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("A_log"):
            h = d["kda_heads"]
            return torch.cat([torch.empty(h).uniform_(1, 16, generator=g).log(), torch.zeros(K - h)])
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
            t = 0.3 * torch.randn(shape, generator=g)
        elif name.endswith("conv1d.weight"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = _rand(g, *shape)
        return t.to(BF).to(F32) if dtype == "F32" else t.to(BF)  # F32 tensors hold F32 values too

    out = {
        f"{LM}embed_tokens.weight": torch.randn(d["vocab_size"], D, generator=g).to(BF),
        f"{LM}norm.weight": (1 + 0.2 * torch.randn(D, generator=g)).to(BF),
        f"{LM}output_attn_res_norm.weight": (1 + 0.2 * torch.randn(D, generator=g)).to(BF),
        f"{LM}output_attn_res_proj.weight": _rand(g, 1, D).to(BF),
        "language_model.lm_head.weight": _rand(g, d["vocab_size"], D).to(BF),
        "vision_tower.patch_embed.proj.weight": torch.randn(8, 3 * 14 * 14, generator=g).to(BF),
        "mm_projector.proj.0.weight": torch.randn(8, 8, generator=g).to(BF),
    }
    nh, dn, dr, dv = d["mla_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    mla_shapes = {
        "self_attn.q_a_proj.weight": (d["q_lora_rank"], D),
        "self_attn.q_a_layernorm.weight": (d["q_lora_rank"],),
        "self_attn.q_b_proj.weight": (nh * (dn + dr), d["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa.weight": (d["kv_lora_rank"] + dr, D),
        "self_attn.kv_a_layernorm.weight": (d["kv_lora_rank"],),
        "self_attn.kv_b_proj.weight": (nh * (dn + dv), d["kv_lora_rank"]),
        "self_attn.o_proj.weight": (D, nh * dv),
        "self_attn.g_proj.weight": (nh * dv, D),
    }
    for i in range(len(KDA_LAYERS) + len(FULL_LAYERS)):
        p = f"{LM}layers.{i}."
        for name, (dtype, shape) in shapes.items():
            kda_part = name.startswith("self_attn.")
            moe_part = name.startswith("block_sparse_moe.")
            if (kda_part and i + 1 not in KDA_LAYERS) or (moe_part and i == 0):
                continue
            if ".experts.0." in name:
                continue  # the routed experts below
            out[p + name] = make(name, dtype, shape)
        if i + 1 in FULL_LAYERS:
            for name, shape in mla_shapes.items():
                out[p + name] = make(name, "BF16", shape)
        if i == 0:
            inter = d["intermediate_size"]
            for name, shape in (
                ("gate_proj", (inter, D)),
                ("up_proj", (inter, D)),
                ("down_proj", (D, inter)),
            ):
                out[p + f"mlp.{name}.weight"] = _rand(g, *shape).to(BF)
            continue
        L, I_ = d["routed_expert_hidden_size"], d["moe_intermediate_size"]
        for e in range(d["num_experts"]):
            for w, shape in (("w1", (I_, L)), ("w2", (L, I_)), ("w3", (I_, L))):
                out[p + f"block_sparse_moe.experts.{e}.{w}.weight"] = _rand(g, *shape).to(BF)
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (weight_packed uint8 [N, K/2], weight_scale E8M0 uint8 [N, K/32]) as an MXFP4 quantizer
    writes them: each 32-block's scale is the power of two that brings its amax to at most 6."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-127)
    e = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    codes = e2m1_encode(blocks / torch.exp2(e).unsqueeze(-1)).reshape(n, k)
    return pack_e2m1(codes), (e + 127).to(torch.uint8)


def mxfp4_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """moonshotai/Kimi-K3's layout: routed experts MXFP4 (weight_packed + E8M0 weight_scale), the rest as
    bf16_tensors. Two planted blocks exercise the exact cast's rewrite: an all-zero block at E8M0 0 (2^-127)
    and a block 19 binades below its tensor's largest exponent holding only 4.0."""
    out = {}
    for name, t in bf16_tensors(seed).items():
        m = re.fullmatch(r"(.*\.experts\.\d+\.w[123])\.weight", name)
        if m is None:
            out[name] = t
            continue
        packed, scale = quantize_mxfp4(t)
        out[f"{m[1]}.weight_packed"], out[f"{m[1]}.weight_scale"] = packed, scale
    first = f"{LM}layers.1.block_sparse_moe.experts.0.w1"
    packed, scale = out[f"{first}.weight_packed"], out[f"{first}.weight_scale"]
    packed[0, 0:16], scale[0, 0] = 0, 0  # the zero block
    scale[1, 1] = int(scale.max()) - 19  # 2 binades below 2^-9 * weight_scale_2
    packed[1, 16:32] = 0x66  # code 6 (4.0) throughout: 2 (or, sharing w3's k_max, 3) binades down it is exact
    return out


def nvfp4_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """nvidia/Kimi-K3-NVFP4's layout, derived from mxfp4_tensors as its converter does (experts cast with
    k_max shared by w1 and w3, input_scale 1.0; FP8_PB_WO attention from the BF16 weights)."""
    src = mxfp4_tensors(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in src.items():
        m = re.fullmatch(r"(.*\.experts\.\d+\.)(w[123])\.weight_(packed|scale)", name)
        if m is not None:
            if m[3] == "scale":
                continue
            base, w = m[1], m[2]
            k_max = mxfp4_k_max(src[f"{base}{w}.weight_scale"])
            if w != "w2":
                k_max = max(
                    mxfp4_k_max(src[f"{base}w1.weight_scale"]), mxfp4_k_max(src[f"{base}w3.weight_scale"])
                )
            q = mxfp4_to_nvfp4(t, src[f"{base}{w}.weight_scale"], k_max)
            out[f"{base}{w}.weight"], out[f"{base}{w}.weight_scale"] = q.weight, q.weight_scale
            out[f"{base}{w}.weight_scale_2"] = q.weight_scale_2.reshape(())
            out[f"{base}{w}.input_scale"] = torch.tensor(1.0)
            continue
        m = re.fullmatch(r".*layers\.(\d+)\.self_attn\.(\w+)\.weight", name)
        if m is not None and m[2] in (FP8_KDA if int(m[1]) + 1 in KDA_LAYERS else FP8_MLA):
            q, s = quantize_fp8_block(t)
            out[name], out[name + "_scale"] = q, s.reshape(()) if s.numel() == 1 else s
            continue
        out[name] = t
    return out


def write(directory: Path, kind: str, seed: int = 0) -> Path:
    """Write the reduced K3 of `kind` ("mxfp4", "nvfp4", "bf16") with its published config files."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"mxfp4": mxfp4_tensors, "nvfp4": nvfp4_tensors, "bf16": bf16_tensors}[kind](seed)
    (directory / "config.json").write_text(json.dumps(config(kind), indent=1))
    if kind == "nvfp4":
        shutil.copy(REAL / "nvidia-Kimi-K3-NVFP4.hf_quant_config.json", directory / "hf_quant_config.json")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_dequantized(src: Path, dst: Path) -> None:
    """The same model with every quantized weight replaced by its exact fp32 dequantization (MXFP4,
    NVFP4, FP8_PB_WO), the scales dropped and no quantization config: the reference of the same weights."""
    t = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, v in t.items():
        base, _, kind = name.rpartition(".")
        if kind == "weight_packed":
            out[f"{base}.weight"] = dequantize_mxfp4(v, t[f"{base}.weight_scale"])
        elif kind == "weight" and v.dtype == torch.uint8:
            out[name] = dequantize_nvfp4(v, t[f"{base}.weight_scale"], t[f"{base}.weight_scale_2"])
        elif kind == "weight" and v.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8_block(v, t[f"{base}.weight_scale"])
        elif kind not in ("weight_scale", "weight_scale_2", "input_scale"):
            out[name] = v
    hf = json.loads((src / "config.json").read_text())
    hf.pop("quantization_config", None)
    hf["text_config"].pop("quantization_config", None)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf))
    save_file(out, str(dst / "model.safetensors"))


def to_transformers5(src: Path, dst: Path) -> None:
    """The same checkpoint under the transformers-5 / ModelOpt-export names: self_attn.forget_gate.{f_a_proj,
    f_b_proj,A_log,dt_bias}, one fused self_attn.conv1d, mlp for block_sparse_moe, and
    experts.N.{gate,up,down}_proj."""
    t = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, v in t.items():
        m = re.fullmatch(r"(.*\.self_attn\.)([qkv])_conv1d\.weight", name)
        if m is not None:
            convs.setdefault(m[1], {})[m[2]] = v
            continue
        new = re.sub(r"\.self_attn\.(f_a_proj|f_b_proj|A_log|dt_bias)", r".self_attn.forget_gate.\1", name)
        new = new.replace(".block_sparse_moe.", ".mlp.")
        new = re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{names[m[2]]}.", new)
        out[new] = v
    for prefix, qkv in convs.items():
        out[prefix + "conv1d.weight"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"))
