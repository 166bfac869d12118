"""What `k3run quantize` writes, k3run loads and inspects alike: every recipe on a K3 in both tensor namings
(original and transformers 5), and the bundled default model whose experts FP8_PB_WO cannot hold."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from k3run.api import load_model
from k3run.quant.algo import QuantAlgo
from k3run.quant.export import RECIPES, quantize_checkpoint
from k3run.quant.plan import build_quant_plan
from tests.k3_published import LM, to_transformers5, write

ASSETS = Path(__file__).resolve().parents[2] / "assets"
IDS = torch.tensor([5, 17, 200, 3, 64, 411, 9])
A = QuantAlgo


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("roundtrip")
    original = write(root / "original", "bf16")
    to_transformers5(original, root / "transformers5")
    return {"original": original, "transformers5": root / "transformers5"}


# (checkpoint module under the original naming, its transformers-5 name) -> scheme per recipe
ROWS = {
    ("layers.1.self_attn.q_proj", "layers.1.self_attn.q_proj"): {"nvfp4": A.NVFP4, "k3-mixed": A.FP8_PB_WO},
    ("layers.1.self_attn.f_a_proj", "layers.1.self_attn.forget_gate.f_a_proj"): {
        "nvfp4": A.NVFP4,
        "k3-mixed": A.FP8_PB_WO,
    },
    ("layers.3.self_attn.kv_b_proj", "layers.3.self_attn.kv_b_proj"): {
        "nvfp4": A.NVFP4,
        "k3-mixed": A.FP8_PB_WO,
    },
    ("layers.2.block_sparse_moe.experts.5.w2", "layers.2.mlp.experts.5.down_proj"): {
        "nvfp4": A.NVFP4,
        "k3-mixed": A.NVFP4,
    },
    ("layers.2.block_sparse_moe.shared_experts.up_proj", "layers.2.mlp.shared_experts.up_proj"): {
        "nvfp4": A.NVFP4,
        "k3-mixed": A.NONE,
    },
    ("layers.2.block_sparse_moe.gate", "layers.2.mlp.gate"): {"nvfp4": A.NONE, "k3-mixed": A.NONE},
}


def _want(recipe: str, by_recipe: dict[str, QuantAlgo]) -> QuantAlgo:
    if recipe == "fp8_pb_wo":  # the NVFP4 recipe's layers, as FP8_PB_WO (every K here is a multiple of 128)
        return A.FP8_PB_WO if by_recipe["nvfp4"] is A.NVFP4 else A.NONE
    return by_recipe[recipe]


@pytest.mark.parametrize("naming", ["original", "transformers5"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_in_both_namings_loads_and_inspects_alike(sources, tmp_path, recipe, naming):
    dst = tmp_path / "q"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every layer of this model fits every recipe: no fallbacks
        quantize_checkpoint(sources[naming], dst, recipe, progress=False)
    model = load_model(dst)
    assert bool(torch.isfinite(model.logits(IDS)).all())
    plan = build_quant_plan(dst)
    col = 0 if naming == "original" else 1
    for names, by_recipe in ROWS.items():
        assert plan.layer(LM + names[col]).algo is _want(recipe, by_recipe), (recipe, names[col])
    # inspect's rows are the schemes the loaded model runs
    attn, moe = model.layers[1].self_attn, model.layers[2].mlp
    assert attn.in_proj.scheme.algo is plan.layer(LM + list(ROWS)[1][col]).algo
    assert (
        attn.f_b_proj.scheme.algo
        is plan.layer(LM + "layers.1.self_attn." + ("forget_gate." * col) + "f_b_proj").algo
    )
    assert moe.experts.algo is plan.layer(LM + list(ROWS)[3][col]).algo
    assert moe.shared_experts.gate_up_proj.scheme.algo is plan.layer(LM + list(ROWS)[4][col]).algo
    assert model.layers[3].self_attn.kv_b_proj.scheme.algo is plan.layer(LM + list(ROWS)[2][col]).algo


def test_fp8_pb_wo_of_the_bundled_model_keeps_its_experts_whole(tmp_path):
    """The default model's experts have K = 64 (w1/w3) and K = 64 (w2): FP8_PB_WO cannot hold them, so each
    bank stays BF16, named in the exclude list by its bank name (what a vLLM-style reader, resolving one
    scheme per bank, looks up) and by its projections; k3run loads and inspects it."""
    dst = tmp_path / "fp8"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_checkpoint(ASSETS / "default-model-bf16", dst, "fp8_pb_wo", progress=False)
    excludes = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    bank = "language_model.model.layers.1.block_sparse_moe.experts"
    assert bank in excludes and f"{bank}.3.w2" in excludes
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == excludes
    model = load_model(dst)
    assert model.layers[1].mlp.experts.algo is A.NONE
    assert model.layers[1].self_attn.in_proj.scheme.algo is A.FP8_PB_WO  # K = hidden 128
    assert bool(torch.isfinite(model.logits(torch.tensor([1, 2, 3]))).all())
    plan = build_quant_plan(dst)
    assert plan.layer(f"{bank}.0.w1").algo is A.NONE
    assert plan.layer("language_model.model.layers.1.self_attn.q_proj").algo is A.FP8_PB_WO
