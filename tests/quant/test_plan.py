from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3run.formats import quantize_fp8_block, quantize_nvfp4
from k3run.quant.algo import QuantAlgo
from k3run.quant.plan import build_quant_plan, implementation_name
from k3run.safetensors_io import CheckpointError

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
NV = {"quant_algo": "NVFP4", "group_size": 16}
PB = {"quant_algo": "FP8_PB_WO"}
D = 128  # hidden size
N_EXPERTS = 4


def _nvfp4(prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    q = quantize_nvfp4(torch.randn(n, k))
    return {
        f"{prefix}.weight": q.weight,
        f"{prefix}.weight_scale": q.weight_scale,
        f"{prefix}.weight_scale_2": q.weight_scale_2,
        f"{prefix}.input_scale": torch.tensor(1.0),
    }


def _fp8(prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    q, s = quantize_fp8_block(torch.randn(n, k))
    if s.numel() == 1:
        s = s.reshape(())  # ModelOpt squeezes a single-tile scale
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": s}


def _mixed_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """A K3-shaped mixed checkpoint: FP8_PB_WO attention (one projection with N % 128 != 0, one single
    tile), NVFP4 routed experts, bf16 router / embeddings / lm_head / norms / conv."""
    bf = torch.bfloat16
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, D, dtype=bf),
        "model.layers.0.input_layernorm.weight": torch.ones(D, dtype=bf),
        "model.layers.0.self_attn.q_conv1d.weight": torch.randn(D, 1, 4, dtype=bf),
        "model.layers.1.block_sparse_moe.gate.weight": torch.randn(N_EXPERTS, D, dtype=bf),
        "lm_head.weight": torch.randn(64, D, dtype=bf),
    }
    t |= _fp8("model.layers.0.self_attn.q_proj", 200, D)
    t |= _fp8("model.layers.0.self_attn.o_proj", D, D)
    layers = {
        "model.layers.0.self_attn.q_proj": PB,
        "model.layers.0.self_attn.o_proj": PB,
    }
    for e in range(N_EXPERTS):
        base = f"model.layers.1.block_sparse_moe.experts.{e}"
        t |= _nvfp4(f"{base}.w1", 32, D) | _nvfp4(f"{base}.w3", 32, D) | _nvfp4(f"{base}.w2", D, 32)
        for w in ("w1", "w2", "w3"):
            layers[f"{base}.{w}"] = NV
    save_file(t, str(d / "model.safetensors"))
    hf = {
        "producer": PRODUCER,
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "quantized_layers": layers,
            "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.1.block_sparse_moe.gate"],
        },
    }
    (d / "hf_quant_config.json").write_text(json.dumps(hf))
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    return t


def _nbytes(t: dict[str, torch.Tensor], prefix: str) -> int:
    return sum(v.numel() * v.element_size() for k, v in t.items() if k.startswith(prefix + "."))


def test_mixed_plan_layers(tmp_path: Path) -> None:
    t = _mixed_checkpoint(tmp_path)
    plan = build_quant_plan(tmp_path)
    assert plan.quant_config is not None and plan.quant_config.is_mixed
    q = plan.layer("model.layers.0.self_attn.q_proj")
    assert q.algo is QuantAlgo.FP8_PB_WO
    assert q.logical_shape == (200, D) and q.physical_shape == (256, D) and q.padding == (56, 0)
    assert q.nbytes == 200 * D + 2 * 4 == _nbytes(t, q.prefix)
    o = plan.layer("model.layers.0.self_attn.o_proj")
    assert o.padding == (0, 0) and o.nbytes == D * D + 4
    w2 = plan.layer("model.layers.1.block_sparse_moe.experts.3.w2")
    assert w2.algo is QuantAlgo.NVFP4
    assert w2.logical_shape == (D, 32) == w2.physical_shape
    assert w2.nbytes == D * 16 + D * 2 + 4 + 4 == _nbytes(t, w2.prefix)
    assert w2.kind == "expert"
    assert w2.implementation.startswith("layers/moe fused_experts: per-expert loop")
    assert q.kind == "linear" and "AVX-512" in q.implementation and "dequantize + matmul" in q.implementation
    gate = plan.layer("model.layers.1.block_sparse_moe.gate")
    assert gate.algo is QuantAlgo.NONE and gate.implementation == "torch F.linear"
    emb = plan.layer("model.embed_tokens")
    assert emb.kind == "embedding" and emb.algo is QuantAlgo.NONE
    # norms and the conv are not linear-like
    assert {lp.prefix for lp in plan.layers}.isdisjoint({"model.layers.0.input_layernorm"})
    assert plan.other_tensors == 2
    assert plan.other_bytes == D * 2 + D * 4 * 2
    by = plan.bytes_by_scheme()
    total = sum(v.numel() * v.element_size() for v in t.values())
    assert sum(by.values()) == total
    expert_bytes = sum(_nbytes(t, f"model.layers.1.block_sparse_moe.experts.{e}") for e in range(N_EXPERTS))
    assert by["NVFP4"] == expert_bytes
    assert by["FP8_PB_WO"] == q.nbytes + o.nbytes
    assert by["embedding"] == 64 * D * 2


def test_mixed_plan_table(tmp_path: Path) -> None:
    _mixed_checkpoint(tmp_path)
    plan = build_quant_plan(tmp_path)
    text = plan.format_table()
    lines = text.splitlines()
    assert "ModelOpt MIXED_PRECISION by modelopt 0.47.0; device cpu" in lines[0]
    row = next(line for line in lines if line.startswith("model.layers.0.self_attn.q_proj"))
    assert row.split()[1:7] == ["FP8_PB_WO", "[200,", "128]", "[256,", "128]", "N+56"]
    # routed experts fold into one row per projection, with the bytes of all of them
    folded = [line for line in lines if "experts.[0..3]" in line]
    assert [line.split()[0] for line in folded] == [
        "model.layers.1.block_sparse_moe.experts.[0..3].w1",
        "model.layers.1.block_sparse_moe.experts.[0..3].w2",
        "model.layers.1.block_sparse_moe.experts.[0..3].w3",
    ]
    assert all(" x4 " in line for line in folded)
    start = lines.index("parameter bytes by scheme:") + 1
    summary = lines[start : lines.index("", start)]
    assert any(s.split()[0] == "NVFP4" and "(12 layers" in s for s in summary)
    assert summary[-1].split()[0] == "total"
    # this partial config.json cannot build the model, and the table says so instead of leaving it out
    assert lines[-1].startswith("  not computed: the model cannot be built from")


def test_cuda_implementation_names_are_kernels() -> None:
    assert implementation_name(QuantAlgo.NVFP4, "cuda:0").startswith("kernels/nvfp4_gemm")
    assert implementation_name(QuantAlgo.FP8_PB_WO, "cuda").startswith("kernels/fp8_gemm")
    assert "compiled loop" in implementation_name(QuantAlgo.FP8_PB_WO, "cpu")
    assert "grouped decode launches" in implementation_name(QuantAlgo.NVFP4, "cuda", kind="expert")
    assert implementation_name(QuantAlgo.FP8, "cpu").startswith("unsupported")


def test_single_algo_plan_and_unquantized(tmp_path: Path) -> None:
    t = _nvfp4("model.layers.0.mlp.up_proj", 64, D)
    t["lm_head.weight"] = torch.randn(32, D, dtype=torch.bfloat16)
    save_file(t, str(tmp_path / "model.safetensors"))
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"], "producer": PRODUCER}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    plan = build_quant_plan(tmp_path, device="cuda")
    assert plan.layer("model.layers.0.mlp.up_proj").algo is QuantAlgo.NVFP4
    assert plan.layer("model.layers.0.mlp.up_proj").logical_shape == (64, D)
    assert plan.layer("lm_head").implementation == "torch F.linear (cuBLAS)"

    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"lm_head.weight": torch.randn(8, 16, dtype=torch.bfloat16)}, str(plain / "model.safetensors"))
    (plain / "config.json").write_text("{}")
    p = build_quant_plan(plain)
    assert p.quant_config is None and p.layers[0].algo is QuantAlgo.NONE
    assert "unquantized (no quantization config)" in p.format_table()


def _rewrite(d: Path, t: dict[str, torch.Tensor]) -> None:
    save_file(t, str(d / "model.safetensors"))


def test_config_disagreeing_with_tensors(tmp_path: Path) -> None:
    t = _mixed_checkpoint(tmp_path)
    w1 = "model.layers.1.block_sparse_moe.experts.2.w1"
    q = "model.layers.0.self_attn.q_proj"
    cases = [
        (
            {f"{w1}.weight": torch.randn(32, D, dtype=torch.bfloat16)},
            (),
            rf"tensor {w1}.weight: expected dtype U8, got BF16 \[32, 128\] \(layer scheme NVFP4",
        ),
        (
            {},
            (f"{w1}.weight_scale",),
            rf"tensor {w1}.weight_scale: expected the tensor to exist, got nothing",
        ),
        (
            {f"{w1}.weight_scale": torch.ones(32, 4).to(torch.float8_e4m3fn)},
            (),
            rf"{w1}.weight_scale: expected shape \[32, 8\], got \[32, 4\]",
        ),
        (
            {f"{w1}.weight_scale_2": torch.ones(2)},
            (),
            rf"{w1}.weight_scale_2: expected an F32 scalar .*got F32 \[2\]",
        ),
        (
            {f"{q}.weight": torch.randn(200, D, dtype=torch.bfloat16)},
            (),
            rf"tensor {q}.weight: expected dtype F8_E4M3, got BF16 \[200, 128\] \(layer scheme FP8_PB_WO",
        ),
        (
            {f"{q}.weight_scale": torch.ones(2, 1, 2, 1)},
            (),
            rf"{q}.weight_scale: expected shape \[2, 1, 1, 1\], got \[2, 1, 2, 1\]",
        ),
        (
            {
                f"{q}.weight": torch.zeros(200, 96).to(torch.float8_e4m3fn),
                f"{q}.weight_scale": torch.ones(2, 1, 1, 1),
            },
            (),
            rf"{q}.weight: expected an input size K divisible by 128 .*got K=96",
        ),
        (
            {"lm_head.weight": torch.zeros(64, D, dtype=torch.uint8)},
            (),
            r"tensor lm_head.weight: expected dtype BF16 or F16 or F32, got U8.*matched by the exclude list",
        ),
        (
            {"model.layers.1.block_sparse_moe.gate.weight_scale": torch.ones(())},
            (),
            r"gate.weight_scale: expected no such tensor, got F32",
        ),
    ]
    for changes, drop, pattern in cases:
        broken = {k: v for k, v in t.items() if k not in drop} | changes
        _rewrite(tmp_path, broken)
        with pytest.raises(ValueError, match=pattern):
            build_quant_plan(tmp_path)


def test_unlisted_quantized_layer_and_missing_config(tmp_path: Path) -> None:
    _mixed_checkpoint(tmp_path)
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())
    del hf["quantization"]["quantized_layers"]["model.layers.0.self_attn.o_proj"]
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ValueError, match=r"o_proj.weight: expected dtype BF16.*not listed in quantized_layers"
    ):
        build_quant_plan(tmp_path)
    (tmp_path / "hf_quant_config.json").unlink()
    with pytest.raises(ValueError, match="got F8_E4M3.*has no quantization config"):
        build_quant_plan(tmp_path)


def test_corrupt_checkpoint_files(tmp_path: Path) -> None:
    _mixed_checkpoint(tmp_path)
    f = tmp_path / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError, match="truncated: tensor"):
        build_quant_plan(tmp_path)
    f.write_bytes(raw[:8] + b"#" + raw[9:])
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON"):
        build_quant_plan(tmp_path)


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_plan_of_real_modelopt_exports() -> None:
    nv, pb = FIXTURES / "llama_nvfp4", FIXTURES / "llama_fp8_pb_wo"
    if not (nv / "model.safetensors").is_file() or not (pb / "model.safetensors").is_file():
        pytest.skip("ModelOpt fixtures missing (written by tests/fixtures/make_fixtures.py)")
    plan = build_quant_plan(nv)
    quantized = [lp for lp in plan.layers if lp.algo is QuantAlgo.NVFP4]
    assert len(quantized) == 7
    assert plan.layer("model.layers.0.mlp.down_proj").logical_shape == (128, 192)
    assert plan.layer("lm_head").algo is QuantAlgo.NONE
    # every byte of the data section is accounted to a layer or "other"
    raw = (nv / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert sum(plan.bytes_by_scheme().values()) == len(raw) - 8 - header_len
    # ModelOpt writes FP8_PB_WO layers with K % 128 != 0 (edge tiles), which k3run and vLLM refuse
    with pytest.raises(
        ValueError, match=r"mlp.down_proj.weight: expected an input size K divisible by 128.*K=192"
    ):
        build_quant_plan(pb)
