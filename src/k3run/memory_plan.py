"""Per-rank memory of a checkpoint under tensor / expert parallelism, from its config alone (`k3run plan`).

The model is built on the meta device as one rank of `tp` would build it (the same layer classes and shard
rules as a real load, so no layout is written down twice), and its parameters are counted by dtype and by
kind (routed experts, attention, the rest), with FP8_PB_WO weights padded to 128-row blocks as loading
pads them. The layouts are the CPU ones: on CUDA, NVFP4 weights also pad their rows to 16 and K to 128.
Beside them: the cache one sequence needs at each context length
(MLA latents grow with the context, KDA states do not) and an estimate of the largest prefill temporaries
for a chunk of `chunk_tokens` tokens (the routed experts' pick buffers, which dominate a Kimi prefill, and
the expanded MLA keys and values of the longest context). No weights are read. nvidia/Kimi-K3-NVFP4 at TP 16
comes to 106.5 GiB of weights a rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

GiB = 1 << 30


@dataclass
class MemoryPlan:
    tp: int
    weights_by_dtype: dict[str, int] = field(default_factory=dict)
    weights_by_kind: dict[str, int] = field(default_factory=dict)
    cache_per_seq: dict[int, int] = field(default_factory=dict)  # context -> bytes per sequence
    temporaries: dict[str, int] = field(default_factory=dict)
    local_experts: int = 0
    num_experts: int = 0

    @property
    def weights(self) -> int:
        return sum(self.weights_by_dtype.values())

    def format(self, max_num_seqs: int, device_gib: float | None) -> str:
        lines = [f"per rank of {self.tp} ({self.local_experts} of {self.num_experts} routed experts):"]
        lines.append(f"  weights {self.weights / GiB:8.2f} GiB")
        for k, v in sorted(self.weights_by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<22} {v / GiB:8.2f} GiB")
        for k, v in sorted(self.weights_by_dtype.items(), key=lambda kv: -kv[1]):
            lines.append(f"    as {k:<19} {v / GiB:8.2f} GiB")
        temp = sum(self.temporaries.values())
        lines.append(f"  prefill temporaries {temp / GiB:8.2f} GiB (estimate)")
        for k, v in self.temporaries.items():
            lines.append(f"    {k:<40} {v / GiB:8.2f} GiB")
        for ctx, per in self.cache_per_seq.items():
            total = self.weights + temp + max_num_seqs * per
            fits = ""
            if device_gib is not None:
                fits = f"  ({'fits' if total <= device_gib * GiB else 'does not fit'} {device_gib:g} GiB)"
            lines.append(
                f"  cache at {ctx:>7} tokens: {per / GiB:8.3f} GiB a sequence; {max_num_seqs} sequences -> "
                f"{total / GiB:8.2f} GiB in all{fits}"
            )
        return "\n".join(lines)


def _kind(name: str) -> str:
    if ".experts." in name or name.endswith(".experts"):
        return "routed experts"
    if ".self_attn." in name:
        return "attention (KDA / MLA)"
    if ".mlp." in name:
        return "other MLP weights"  # shared experts, latent projections, routers, the dense layer
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings, lm_head"
    return "norms, AttnRes"


def memory_plan(
    model_dir: str | Path, tp: int, contexts: list[int], chunk_tokens: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
) -> MemoryPlan:  # fmt: skip
    """The plan of rank 0 of `tp` (every rank holds the same shapes) for the checkpoint at model_dir."""
    from k3run.config import ModelConfig
    from k3run.distributed import TPInfo
    from k3run.engine.cache import cache_layout_for
    from k3run.models.kimi import KimiForCausalLM
    from k3run.quant.modelopt import load_quant_config

    d = Path(model_dir)
    hf = json.loads((d / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    qcfg = load_quant_config(d)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, qcfg=qcfg, tp=TPInfo(rank=0, size=tp), params_dtype=dtype)
    plan = MemoryPlan(tp=tp, num_experts=cfg.num_experts or 0)
    from k3run.quant.schemes import FP8_BLOCK, Fp8PbWoScheme, _round_up

    # FP8_PB_WO linears pad their weight rows to whole 128-row blocks after loading (the scheme's
    # process_after_loading): count the padded rows
    padded = {
        f"{mname}.weight": _round_up(m.weight.shape[0], FP8_BLOCK) / m.weight.shape[0]
        for mname, m in model.named_modules()
        if isinstance(getattr(m, "scheme", None), Fp8PbWoScheme)
    }
    for name, p in model.named_parameters():
        n = int(p.numel() * p.element_size() * padded.get(name, 1))
        dt = str(p.dtype).removeprefix("torch.")
        plan.weights_by_dtype[dt] = plan.weights_by_dtype.get(dt, 0) + n
        plan.weights_by_kind[_kind(name)] = plan.weights_by_kind.get(_kind(name), 0) + n
    plan.local_experts = (cfg.num_experts or 0) // tp if cfg.num_experts else 0
    layout = cache_layout_for(cfg, dtype, tp)
    plan.cache_per_seq = {c: layout.bytes_per_seq(c) for c in contexts}
    item = torch.empty((), dtype=dtype).element_size()
    top_k = cfg.num_experts_per_token if cfg.num_experts else 0
    if top_k:
        picks = chunk_tokens * top_k
        de = cfg.routed_expert_hidden_size or cfg.hidden_size
        # GEMM1's activation output [picks, I], GEMM2's output [picks, D_e], the fp32 weighted sum's
        # [T, top_k, D_e] view of it, the sort (int64 order and keys) and the group table
        plan.temporaries["routed experts (picks of one chunk)"] = (
            picks * cfg.moe_intermediate_size * item + picks * de * item + picks * de * 4 + picks * 8 * 3
        )
    if any(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)):
        heads = cfg.num_attention_heads // tp
        longest = max(contexts)
        dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        # kv_b_proj's output and the fused attention's [k_nope ; k_pe] over the whole context
        plan.temporaries[f"MLA expanded keys / values at {longest} tokens"] = (
            longest * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + dqk) * item
        )
    return plan
