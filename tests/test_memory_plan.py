"""`k3run plan` (k3run.memory_plan): per-rank memory from the config alone, against the bytes a real load
holds, and the published nvidia/Kimi-K3-NVFP4 at TP 16 / EP 16 against a count written from its config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3run.cli import ASSETS_DIR, main
from k3run.memory_plan import GiB, memory_plan

K3_NVFP4 = Path(__file__).parents[1] / "bench" / "configs"


@pytest.mark.parametrize("name", ["default-model-k3-mixed", "default-model-bf16"])
def test_the_plan_counts_the_bytes_a_load_holds(name: str) -> None:
    from k3run.api import load_model

    d = ASSETS_DIR / name
    plan = memory_plan(d, 1, [256, 1024])
    model = load_model(d, dtype=torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.weights == held
    from k3run.engine.cache import cache_layout_for

    layout = cache_layout_for(model.config, torch.bfloat16)
    assert plan.cache_per_seq == {256: layout.bytes_per_seq(256), 1024: layout.bytes_per_seq(1024)}


@pytest.fixture
def k3_nvfp4(tmp_path: Path) -> Path:
    """nvidia/Kimi-K3-NVFP4's published config.json and hf_quant_config.json (no weights)."""
    for src, dst in (("nvidia_kimi_k3_nvfp4.config.json", "config.json"),
                     ("nvidia_kimi_k3_nvfp4.hf_quant_config.json", "hf_quant_config.json")):  # fmt: skip
        (tmp_path / dst).write_bytes((K3_NVFP4 / src).read_bytes())
    return tmp_path


def test_k3_nvfp4_at_tp16_ep16(k3_nvfp4: Path, capsys) -> None:
    """56 of 896 routed experts a rank; their bytes as NVFP4 (E2M1 codes 0.5 byte a weight, one E4M3 scale
    per 16, fp32 global scales, and every expert's input scales on every rank) counted from the config by
    hand, exactly; the whole rank under an H200's 139 GiB with 8 sequences of 32K and of 128K tokens; the
    command prints it."""
    hf = json.loads((k3_nvfp4 / "config.json").read_text())["text_config"]
    plan = memory_plan(k3_nvfp4, 16, [32768, 131072])
    assert (plan.local_experts, plan.num_experts) == (56, 896)
    d, i = hf["routed_expert_hidden_size"], hf["moe_intermediate_size"]
    moe_layers = sum(1 for j in range(hf["num_hidden_layers"]) if j >= hf.get("first_k_dense_replace", 0))
    weights = 3 * d * i  # w1, w3 [I, D], w2 [D, I]
    per_expert = weights // 2 + weights // 16 + 4 * 3  # E2M1 codes, E4M3 group scales, weight_scale_2 (fp32)
    input_scales = 896 * 3 * 4  # every rank keeps all experts' input scales (a13 / a2 are maxima over all)
    assert plan.weights_by_kind["routed experts"] == moe_layers * (56 * per_expert + input_scales)
    assert 90 * GiB < plan.weights < 120 * GiB
    assert main(["plan", str(k3_nvfp4), "--tp", "16", "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert "56 of 896 routed experts" in out and out.count("(fits 139 GiB)") == 2
