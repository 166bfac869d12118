"""The committed Kimi Linear fixtures (tests/fixtures/, written by HF transformers 5.24 and ModelOpt 0.47):
the bf16 checkpoint against HF's fp32 logits, the NVFP4 export (transformers-5 naming) against a model built
from its own dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3run.api import load_model
from k3run.loader import LoadError
from k3run.testing import assert_close, rel_rms_error
from tests.model_builders import write_dequantized_copy

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BF16 = FIXTURES / "kimi_linear_bf16"
NVFP4 = FIXTURES / "kimi_linear_nvfp4"
FP8 = FIXTURES / "kimi_linear_fp8_pb_wo"


def _reference() -> dict[str, torch.Tensor]:
    return load_file(str(BF16 / "reference.safetensors"))


def test_bf16_fixture_matches_hf_reference_logits():
    ref = _reference()
    model = load_model(BF16, dtype=torch.float32)
    out = model.logits(ref["input_ids"])
    assert out.dtype == torch.float32 and out.shape == ref["logits"].shape
    # Same bf16-valued weights, both computed in fp32: only the order of fp32 roundings differs (measured
    # 1.2e-6 relative RMS); a wrong router, gate, norm weight or residual is O(1e-2) or worse.
    assert_close("kimi_linear_bf16 vs HF fp32 logits", ref["logits"], out, rtol=1e-5)


def test_nvfp4_fixture_matches_its_dequantized_weights(tmp_path):
    ref = _reference()
    quant = load_model(NVFP4, dtype=torch.float32)  # transformers-5 names, loaded as exported
    experts = quant.layers[1].mlp.experts
    assert experts.algo.value == "NVFP4" and experts.scheme.act_mode == "w4a16"
    assert quant.layers[0].self_attn.in_proj.scheme.describe().startswith("NVFP4")
    write_dequantized_copy(NVFP4, tmp_path / "deq")
    deq = load_model(tmp_path / "deq")
    assert deq.layers[1].mlp.experts.algo.value == "NONE"
    out, out_deq = quant.logits(ref["input_ids"]), deq.logits(ref["input_ids"])
    # W4A16 computes with exactly the dequantized weights: fp32 rounding order only
    assert_close("nvfp4 fixture vs its dequantized weights", out_deq, out, rtol=1e-5)
    # and it is a different model from the bf16 one (NVFP4 weight error ~0.1 per weight)
    assert rel_rms_error(ref["logits"], out) > 1e-2


def test_nvfp4_fixture_w4a4_experts_run():
    ref = _reference()
    w4a16 = load_model(NVFP4, dtype=torch.float32).logits(ref["input_ids"])
    w4a4 = load_model(NVFP4, dtype=torch.float32, nvfp4_moe_act="w4a4").logits(ref["input_ids"])
    assert torch.isfinite(w4a4).all()
    # expert activations quantized to NVFP4 (E2M1, ~2^-2..2^-3 relative per element) move the logits
    # measurably but not beyond the size of the logits themselves
    assert 1e-4 < rel_rms_error(w4a16, w4a4) < 1.0


def test_fp8_pb_wo_fixture_with_k_not_multiple_of_128_is_refused_clearly():
    # hidden 64: FP8_PB_WO's dynamic 1x128 activation groups need K % 128 == 0 (vLLM refuses it as well)
    if not (FP8 / "model.safetensors").is_file():
        pytest.skip("fixture not generated")
    with pytest.raises((ValueError, LoadError), match=r"model\.layers\.0\..*divisible by 128"):
        load_model(FP8)


def test_load_model_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="tp_size=2 needs an initialised torch.distributed"):
        load_model(BF16, tp_rank=0, tp_size=2)
