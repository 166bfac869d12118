"""The published K3 checkpoints, reduced (tests/k3_published.py): moonshotai/Kimi-K3 (compressed-tensors
MXFP4 experts) and nvidia/Kimi-K3-NVFP4 (ModelOpt MIXED_PRECISION) with their verbatim quantization configs
load, run, and compute what the same dequantized weights compute; inspect resolves them as load does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3run.api import load_model
from k3run.formats import dequantize_mxfp4, dequantize_nvfp4
from k3run.loader import LoadError
from k3run.quant.algo import QuantAlgo
from k3run.quant.plan import build_quant_plan
from k3run.testing import assert_close
from tests.k3_published import DIMS, LM, REAL, layer1_shapes, real_dims, write, write_dequantized

IDS = torch.tensor([5, 17, 200, 3, 64, 411, 9])
EXPERT0 = f"{LM}layers.1.block_sparse_moe.experts.0"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("k3_published")
    out = {kind: write(root / kind, kind) for kind in ("mxfp4", "nvfp4")}
    for kind in ("mxfp4", "nvfp4"):
        write_dequantized(out[kind], root / f"{kind}_deq")
        out[f"{kind}_deq"] = root / f"{kind}_deq"
    return out


def test_builder_follows_the_published_header_rows():
    """With the real widths the builder's shape rules give exactly moonshotai/Kimi-K3's layer-1 rows."""
    rows = json.loads((REAL / "moonshotai-Kimi-K3.layer1-header-rows.json").read_text())
    published = {n: (dt, tuple(shape)) for n, dt, shape in rows["kda_specs"] + rows["moe_specs"]}
    published |= {n: (dt, tuple(shape)) for n, dt, shape, _ in rows["expert0_specs_with_offsets"]}
    assert layer1_shapes(real_dims() | {k: v for k, v in DIMS.items() if k not in real_dims()}) == published


def _expert_weights(model, layer: int, e: int) -> dict[str, torch.Tensor]:
    ex = model.layers[layer].mlp.experts
    i = ex.intermediate_size
    rows = [slice(0, i), slice(i, 2 * i)]
    w13 = [
        dequantize_nvfp4(ex.w13_weight[e, r], ex.w13_weight_scale[e, r], ex.w13_weight_scale_2[e, h])
        for h, r in enumerate(rows)
    ]
    w2 = dequantize_nvfp4(ex.w2_weight[e], ex.w2_weight_scale[e], ex.w2_weight_scale_2[e])
    return {"w1": w13[0], "w3": w13[1], "w2": w2}


def test_mxfp4_k3_loads_and_equals_its_dequantized_weights(dirs, caplog):
    with caplog.at_level(logging.INFO, logger="k3run.api"):
        model = load_model(dirs["mxfp4"])  # bf16, as published
    assert model.params_dtype == torch.bfloat16
    experts = model.layers[1].mlp.experts
    assert experts.mxfp4 and experts.algo is QuantAlgo.NVFP4 and experts.scheme.act_mode == "w4a16"
    assert model.layers[1].self_attn.in_proj.scheme.algo is QuantAlgo.NONE  # BF16 in the checkpoint
    assert model.layers[1].self_attn.o_norm.weight.dtype == torch.float32
    log = caplog.text
    assert "compressed-tensors mxfp4-pack-quantized" in log
    assert 'target ("Linear") but the checkpoint stores as plain float weights' in log
    assert "self_attn.o_norm.weight (F32 [128] x3) -> float32" in log
    logits = model.logits(IDS)
    assert logits.shape == (len(IDS), DIMS["vocab_size"]) and bool(torch.isfinite(logits).all())
    # the cast is exact: every loaded expert decodes to the checkpoint's MXFP4 values, bit for bit
    t = load_file(str(dirs["mxfp4"] / "model.safetensors"))
    for layer, e in ((1, 0), (2, 5), (3, 7)):
        got = _expert_weights(model, layer, e)
        for w in ("w1", "w2", "w3"):
            base = f"{LM}layers.{layer}.block_sparse_moe.experts.{e}.{w}"
            want = dequantize_mxfp4(t[f"{base}.weight_packed"], t[f"{base}.weight_scale"])
            assert torch.equal(got[w], want), base
    # the planted block 19 binades down had its 4.0 codes rewritten to 1.0 (and 2 binades less scale)
    assert bool((experts.w13_weight[0, 1, 16:32] == 0x22).all())
    # the whole model in fp32 against a bf16/fp32 model of the same dequantized weights: the experts run
    # W4A16 on exactly those weights, so only fp32 summation order differs (~1e-7 per op; a wrong scale,
    # code or shard is O(1))
    ref = load_model(dirs["mxfp4_deq"], dtype=torch.float32).logits(IDS)
    out = load_model(dirs["mxfp4"], dtype=torch.float32).logits(IDS)
    assert_close("MXFP4 K3 vs its dequantized weights", ref, out, rtol=1e-5)


def test_nvfp4_k3_loads_and_equals_its_dequantized_weights(dirs, monkeypatch):
    model = load_model(dirs["nvfp4"])
    experts = model.layers[2].mlp.experts
    assert experts.algo is QuantAlgo.NVFP4 and not experts.mxfp4
    assert model.layers[1].self_attn.in_proj.scheme.algo is QuantAlgo.FP8_PB_WO
    assert model.layers[3].self_attn.kv_b_proj.scheme.algo is QuantAlgo.FP8_PB_WO
    assert model.layers[0].mlp.gate_up_proj.scheme.algo is QuantAlgo.NONE  # excluded: layers.0.mlp.*
    assert bool(torch.isfinite(model.logits(IDS)).all())
    # FP8_PB_WO linears quantize their activations to 1x128 e4m3 groups (3 mantissa bits; measured 0.21
    # relative RMS on these logits, top-2-of-8 routing flips included; an unrelated model is ~1.4). With that
    # quantization made the identity they compute exactly the dequantized weights' products, so the whole
    # model must then equal the reference up to fp32 summation order (~1e-7 measured)
    import k3run.formats

    monkeypatch.setattr(k3run.formats, "quantize_fp8_act_1x128", lambda x: (x.float(), None))
    monkeypatch.setattr(k3run.formats, "dequantize_fp8_act_1x128", lambda q, s: q)
    ref = load_model(dirs["nvfp4_deq"], dtype=torch.float32).logits(IDS)
    out = load_model(dirs["nvfp4"], dtype=torch.float32).logits(IDS)
    assert_close("NVFP4 K3 (exact activations) vs its dequantized weights", ref, out, rtol=1e-5)
    # its experts are the MXFP4 experts, exactly (the converter's cast, k_max shared by w1 and w3)
    mx = load_model(dirs["mxfp4"])
    for w in ("w1", "w2", "w3"):
        assert torch.equal(_expert_weights(model, 2, 4)[w], _expert_weights(mx, 2, 4)[w])


def test_inspect_resolves_as_load_does(dirs):
    mx = build_quant_plan(dirs["mxfp4"])
    table = mx.format_table()
    assert "compressed-tensors mxfp4-pack-quantized" in table.splitlines()[0]
    row = mx.layer(f"{EXPERT0}.w2")
    assert row.algo is QuantAlgo.MXFP4 and row.logical_shape == (256, 128)
    assert row.implementation.startswith("MXFP4 (compressed-tensors) -> NVFP4 transcode at load (lossless)")
    assert mx.layer(f"{LM}layers.1.self_attn.q_proj").algo is QuantAlgo.NONE
    assert any('target ("Linear")' in n for n in mx.config_notes)
    assert any("self_attn.o_norm.weight (F32 [128] x3) -> float32" in n for n in mx.held_dtype_notes)
    nv = build_quant_plan(dirs["nvfp4"])
    # keyed by bank in the config, resolved per expert projection here: the same resolution as load
    assert {nv.layer(f"{LM}layers.{i}.block_sparse_moe.experts.{e}.w{w}").algo for i in (1, 2, 3)
            for e in (0, 7) for w in (1, 2, 3)} == {QuantAlgo.NVFP4}  # fmt: skip
    assert nv.layer(f"{LM}layers.3.self_attn.q_b_proj").algo is QuantAlgo.FP8_PB_WO
    assert nv.layer(f"{LM}layers.0.mlp.down_proj").algo is QuantAlgo.NONE
    assert "ModelOpt MIXED_PRECISION by modelopt 0.45.0" in nv.format_table().splitlines()[0]


def _rewrite(src: Path, dst: Path, change) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(str(src / "model.safetensors"))
    change(t, dst)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_refusals_name_the_tensor(dirs, tmp_path):
    def a_log_tail(t, _):
        t[f"{LM}layers.2.self_attn.A_log"][100] = 0.5

    d = _rewrite(dirs["mxfp4"], tmp_path / "a_log", a_log_tail)
    with pytest.raises(
        LoadError, match=r"layers\.2\.self_attn\.A_log.*must be zero after them.*index 100: 0\.5"
    ):
        load_model(d)

    def lossy(t, _):  # 1.5 two binades below E4M3's reach: no exact NVFP4 code
        t[f"{EXPERT0}.w1.weight_packed"][1, 16] = 0x63

    d = _rewrite(dirs["mxfp4"], tmp_path / "lossy", lossy)
    lossy_msg = (
        r"experts\.0\.w1\.weight_(packed|scale).*row 1, 32-block 1: MXFP4 value 1\.5 .*refusing a lossy"
    )
    with pytest.raises(LoadError, match=lossy_msg):
        load_model(d)

    def ignored(_, dst):  # the config ignoring the experts that are stored MXFP4-packed
        hf = json.loads((dst / "config.json").read_text())
        hf["text_config"]["quantization_config"]["ignore"].append("re:.*experts.*")
        (dst / "config.json").write_text(json.dumps(hf))

    d = _rewrite(dirs["mxfp4"], tmp_path / "ignored", ignored)
    with pytest.raises(ValueError, match=r"experts: its experts are stored weight_packed \(MXFP4\), but .*"
                       r"does not quantize them"):  # fmt: skip
        load_model(d)

    def unsupported(_, dst):
        hf = json.loads((dst / "config.json").read_text())
        hf["text_config"]["quantization_config"]["config_groups"]["group_0"]["format"] = (
            "nvfp4-pack-quantized"
        )
        (dst / "config.json").write_text(json.dumps(hf))

    d = _rewrite(dirs["mxfp4"], tmp_path / "format", unsupported)
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.format: expected 'mxfp4-pack-quantized'.*"
                       r"got 'nvfp4-pack-quantized'"):  # fmt: skip
        load_model(d)


def _tp_worker(tp, d: str, ids: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(1)
    return load_model(d, dtype=torch.float32, tp_rank=tp.rank, tp_size=tp.size).logits(ids)


def test_mxfp4_k3_tp2_equals_tp1(dirs):
    """Each rank casts only its own experts (EP 2: 4 of 8) and its heads' A_log values."""
    from tests.gloo import spawn_gloo

    ranks = spawn_gloo(_tp_worker, 2, str(dirs["mxfp4"]), IDS)
    ref = load_model(dirs["mxfp4"], dtype=torch.float32).logits(IDS)
    assert torch.equal(ranks[0], ranks[1])
    # sharded GEMMs and experts split over ranks change fp32 summation order only
    assert_close("MXFP4 K3 TP=2 vs TP=1", ref, ranks[0], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_published_layouts_load_and_run_on_cuda(dirs, kind):
    """Both layouts load onto a GPU (the MXFP4 cast runs on the CPU-read tensors and lands in device
    parameters) and run its kernels. The experts' output is compared directly, on one input and one routing
    for both devices: the weights are exact on both (W4A16), and the GPU rounds GEMM1's output h and the
    result to bf16 (2^-9 relative each), so relative RMS < 1e-2. Whole-model logits are only checked finite:
    in bf16 a random model's router flips top-k choices at some prompts (measured on an H200: 0.8-13% from
    fp32 on both devices alike, whichever MoE launch runs)."""
    from k3run.layers.moe import fused_experts

    cpu = load_model(dirs[kind], dtype=torch.float32)
    gpu = load_model(dirs[kind], dtype=torch.bfloat16, device="cuda")
    assert torch.isfinite(gpu.logits(IDS.cuda()).float()).all()
    ec, eg = cpu.layers[1].mlp.experts, gpu.layers[1].mlp.experts
    g = torch.Generator().manual_seed(3)
    for t in (1, 5, 37):
        x = torch.randn(t, ec.hidden_size, generator=g).bfloat16()
        ids = torch.stack(
            [torch.randperm(DIMS["num_experts"], generator=g)[: DIMS["top_k"]] for _ in range(t)]
        )
        w = torch.rand(t, DIMS["top_k"], generator=g)
        ref = fused_experts(ec, x.float(), ids, w)
        out = fused_experts(eg, x.cuda(), ids.cuda(), w.cuda()).float().cpu()
        assert_close(f"{kind} experts on cuda, {t} tokens", ref, out, rtol=1e-2)
