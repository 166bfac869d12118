"""compressed-tensors configs (quant/compressed_tensors.py): moonshotai/Kimi-K3's, resolved against its real
layer-1 header rows, and a clear error for each thing k3run does not support."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from k3run.quant.algo import QuantAlgo
from k3run.quant.compressed_tensors import parse_compressed_tensors
from k3run.quant.modelopt import load_quant_config
from k3run.quant.schemes import linear_scheme_for

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real_checkpoints"
HF = json.loads((REAL / "moonshotai-Kimi-K3.config.json").read_text())
QC = HF["text_config"]["quantization_config"]
L1 = "language_model.model.layers.1"


def _stored_from_header_rows() -> dict[str, str]:
    """module -> stored kind, from the published layer-1 rows (as stored_modules derives it from headers)."""
    rows = json.loads((REAL / "moonshotai-Kimi-K3.layer1-header-rows.json").read_text())
    out = {}
    for name, dtype, shape, *_ in rows["kda_specs"] + rows["moe_specs"] + rows["expert0_specs_with_offsets"]:
        prefix, _, last = f"{L1}.{name}".rpartition(".")
        if last == "weight_packed":
            out[prefix] = "packed"
        elif last == "weight" and len(shape) == 2:
            out.setdefault(prefix, dtype)
    return out


def test_published_config_against_its_header_rows():
    cfg = parse_compressed_tensors(QC, source="K3", stored=_stored_from_header_rows())
    assert [g.targets for g in cfg.groups] == [("Linear",)] and cfg.ignore == ("re:.*shared_experts.*",)
    # routed experts: weight_packed in the checkpoint, targeted by "Linear" -> MXFP4, asked as the model
    # asks (the bank, its own naming) or as inspect asks (an expert projection, the checkpoint's)
    assert cfg.resolve("model.layers.1.mlp.experts", num_experts=1) is QuantAlgo.MXFP4
    assert cfg.resolve(f"{L1}.block_sparse_moe.experts.0.w2", num_experts=1) is QuantAlgo.MXFP4
    # "Linear" also targets the attention and latent projections, which the checkpoint stores BF16
    kda = [
        f"model.layers.1.self_attn.{p}"
        for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
    ]
    assert cfg.resolve("model.layers.1.self_attn.in_proj", kda) is QuantAlgo.NONE
    assert cfg.resolve("model.layers.1.mlp.routed_expert_down_proj") is QuantAlgo.NONE
    # shared experts are ignored (and stored BF16)
    assert cfg.resolve(f"{L1}.block_sparse_moe.shared_experts.up_proj") is QuantAlgo.NONE
    assert cfg.is_excluded("model.layers.1.mlp.shared_experts.gate_proj")
    [note] = cfg.notes()
    assert "7 stored BF16" in note and 'target ("Linear")' in note
    assert "shared_experts" not in note
    assert cfg.explain("model.layers.1.self_attn.o_proj", QuantAlgo.NONE).endswith(
        "targeted, but stored unquantized (a plain .weight, no weight_packed)"
    )


def test_config_alone_and_where_it_is_read():
    # without the checkpoint's headers a "Linear" target is taken at its word: a linear layer is MXFP4,
    # which k3run refuses outside the routed experts
    cfg = load_quant_config(HF)
    assert cfg is not None and cfg.resolve("model.layers.1.mlp.experts") is QuantAlgo.MXFP4
    with pytest.raises(ValueError, match=r"q_a_proj: the quantization config makes this linear layer MXFP4"):
        linear_scheme_for(cfg, "model.layers.3.self_attn.q_a_proj", params_dtype=torch.bfloat16)
    both = copy.deepcopy(HF) | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    msg = r"\(quant_method 'modelopt'\) and text_config.quantization_config \(quant_method 'compressed-"
    with pytest.raises(ValueError, match=msg):
        load_quant_config(both)


def _with(path: tuple[str, ...], value: object) -> dict:
    qc = copy.deepcopy(QC)
    d = qc
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value
    return qc


G = ("config_groups", "group_0")


@pytest.mark.parametrize(
    "qc, match",
    [
        (_with((*G, "format"), "nvfp4-pack-quantized"), r"group_0\.format: expected 'mxfp4-pack-quantized'"),
        (
            _with((*G, "input_activations"), {"num_bits": 4, "type": "float"}),
            r"input_activations: expected null",
        ),
        (_with((*G, "weights", "num_bits"), 8), r"weights\.num_bits: expected 4"),
        (_with((*G, "weights", "type"), "int"), r"weights\.type: expected 'float'"),
        (_with((*G, "weights", "group_size"), 16), r"weights\.group_size: expected 32"),
        (
            _with((*G, "weights", "zero_points"), 1),
            r"weights: expected only the keys .* got \['zero_points'\]",
        ),
        (_with((*G, "targets"), ["Embedding"]), r"targets: expected class names k3run knows \(Linear\)"),
        (_with((*G, "targets"), ["re:(unclosed"]), r"targets: expected valid regexes"),
        (_with(("ignore",), "lm_head"), r"ignore: expected a list"),
        (_with(("kv_cache_scheme",), {"num_bits": 8}), r"kv_cache_scheme: expected null"),
        (
            _with(("sparsity_config",), {"format": "sparse-24-bitmask"}),
            r"sparsity_config: expected null or empty",
        ),
        (_with(("config_groups",), {}), r"config_groups: expected a non-empty object"),
    ],
)
def test_unsupported_configs_name_the_field(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_compressed_tensors(qc)
