"""The opt-in NVFP4 -> FP8 128x128-block path (issue 6 section 2): the conversion's accuracy cost against the
exact dequantized NVFP4 weight, the per-shape rule, the scheme wiring, inspect and the load_model flag.

Accuracy argument for the bounds below. The exact NVFP4 weight is e2m1 (2 significant bits) x e4m3 block
scale (4 bits) x fp32 global scale, so it has up to 6 significant bits. The conversion divides each
128x128 tile by its scale s = amax/448 and rounds to E4M3 (4 significant bits, round to nearest even), so a
value landing in E4M3's normal range (|w/s| >= 2^-6) moves by at most half an ulp, 2^-4 relative; below it
(subnormals, spacing 2^-9) by at most 2^-10 * s absolute. Elementwise: |err| <= max(2^-4 |w|, 2^-10 s), and
the relative RMS error over a tensor is below 2^-4 (the GPU run measured 2.9e-2, bench/RESULTS.md run 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3run.cli import build_parser
from k3run.cli import main as cli_main
from k3run.formats import dequantize_fp8_block, dequantize_nvfp4, quantize_nvfp4
from k3run.kernels.fp8_gemm import fp8_pb_wo_linear_ref
from k3run.kernels.nvfp4_gemm import nvfp4_to_fp8_block
from k3run.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from k3run.quant.algo import QuantAlgo
from k3run.quant.plan import build_quant_plan, nvfp4_fp8_implementation
from k3run.quant.schemes import NvFp4Scheme, nvfp4_fp8_faster
from k3run.testing import RTOL, assert_close, rel_rms_error
from tests.tp_utils import activation_reference, checkpoint_tensors, load_shards

E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: half an ulp relative to the value, for normal numbers
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # subnormal spacing 2^-9, in units of the tile scale
# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32 matmul over K <= 512 terms of O(1) products: accumulated rounding far below 1e-5 relative


def _nvfp4_weight(n: int, k: int, row_scales: bool) -> tuple[torch.Tensor, ...]:
    """Random NVFP4 tensors (outliers included so tiles span many binades) and the exact fp32 weight."""
    w = torch.randn(n, k) * torch.exp(torch.randn(n, 1))
    w[torch.rand(n, k) < 0.01] *= 20
    q = quantize_nvfp4(w)
    gs = q.weight_scale_2.reshape(1)
    if row_scales:  # per-row global scales, as fused partitions with their own weight_scale_2 have
        gs = gs * torch.exp2(torch.randint(-3, 4, (n,)).float())
    exact = dequantize_nvfp4(q.weight, q.weight_scale, 1.0) * gs.reshape(-1, 1)
    return q.weight, q.weight_scale, gs, exact


@pytest.mark.parametrize("row_scales", [False, True], ids=["tensor_scale", "row_scales"])
def test_conversion_error_is_one_e4m3_rounding(row_scales: bool) -> None:
    n, k = 300, 384  # N not a multiple of 128: the last tile is padded
    weight, weight_scale, gs, exact = _nvfp4_weight(n, k, row_scales)
    q, scale = nvfp4_to_fp8_block(weight, weight_scale, gs)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (384, k)
    assert tuple(scale.shape) == (3, 3) and scale.dtype == torch.float32
    assert int(torch.count_nonzero(q[n:].view(torch.uint8))) == 0, "pad rows must be exact zeros"
    conv = dequantize_fp8_block(q, scale)[:n]

    err = (conv - exact).abs()
    tile_scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n]
    bound = torch.maximum(E4M3_HALF_ULP * exact.abs(), E4M3_SUBNORMAL_HALF_STEP * tile_scale)
    worst = (err / bound).max().item()
    assert worst <= 1.0 + 1e-6, f"an element moved {worst:.3f}x its E4M3 rounding bound"

    rel = rel_rms_error(exact, conv)
    # the cost is real (6 -> 4 significant bits) and within one rounding
    assert 1e-3 < rel < E4M3_HALF_ULP, rel


def test_rule_follows_the_measurements() -> None:
    # large M: FP8 on every shape, but only through block-scaled _scaled_mm
    assert nvfp4_fp8_faster(4096, 3072, 3584, "scaled_mm")
    assert nvfp4_fp8_faster(17, 2112, 7168, "scaled_mm")
    assert not nvfp4_fp8_faster(4096, 7168, 7168, "triton")
    assert not nvfp4_fp8_faster(4096, 7168, 7168, "ref")
    # small M: the Gluon NVFP4 decode kernel was measured faster than FP8 on every shape (run 8)
    assert not nvfp4_fp8_faster(1, 7168, 7168, "scaled_mm")
    assert not nvfp4_fp8_faster(16, 12288, 7168, "scaled_mm")
    assert not nvfp4_fp8_faster(1, 3072, 3584, "scaled_mm")
    assert not nvfp4_fp8_faster(16, 3584, 3072, "scaled_mm")


def _fused_layer(scheme: NvFp4Scheme) -> tuple[MergedColumnParallelLinear, torch.Tensor]:
    """Two fused partitions whose global scales differ by a non-power of two (kept per partition)."""
    k = 256
    w0, w1 = torch.randn(96, k), torch.randn(200, k) * 3.3
    tensors = [checkpoint_tensors("nvfp4", w) for w in (w0, w1)]
    layer = MergedColumnParallelLinear(k, [96, 200], bias=True, scheme=scheme, params_dtype=torch.float32)
    load_shards(layer, tensors, merged=True)
    layer.bias.weight_loader(layer.bias, torch.randn(96), 0)
    layer.bias.weight_loader(layer.bias, torch.randn(200), 1)
    layer.process_after_loading()
    return layer, layer.dequantized_weight()


def test_scheme_runs_the_fp8_copy_where_the_rule_says() -> None:
    # the default rule never picks the CPU reference backend, so a test rule stands in: FP8 above M = 4
    scheme = NvFp4Scheme(QuantAlgo.NVFP4, fp8_choice=lambda m, n, k, backend: m > 4)
    layer, exact_w = _fused_layer(scheme)
    x_small, x_large = torch.randn(3, 256), torch.randn(2, 5, 256)
    before_small, before_large = layer(x_small), layer(x_large)

    assert scheme.enable_fp8_blocks(layer, backend="ref")
    fp8 = layer.nvfp4_fp8
    assert fp8 is not None and fp8.n == 296 and tuple(fp8.weight.shape) == (384, 256)

    # M = 3: still the NVFP4 path, bit for bit
    assert torch.equal(layer(x_small), before_small)
    # M = 10: the FP8 path, exactly fp8_pb_wo's reference on the converted weight (bias included)
    out = layer(x_large)
    assert tuple(out.shape) == (2, 5, 296)
    want = fp8_pb_wo_linear_ref(x_large.reshape(10, 256), fp8.weight, fp8.scale, 296, layer.bias)
    assert_close("fp8 copy vs fp8_pb_wo reference", want.reshape(2, 5, 296), out, RTOL[torch.float32])
    # and within two E4M3 roundings (weight and 1x128 activation) of the exact NVFP4 product
    exact = x_large.float() @ exact_w.t() + layer.bias
    assert_close("fp8 copy vs exact NVFP4", exact, out, rtol=2 * E4M3_HALF_ULP)
    assert rel_rms_error(exact, out) > rel_rms_error(exact, before_large)  # the cost is visible
    # the activation quantization is part of that cost
    act = activation_reference("fp8", x_large.reshape(10, 256))
    w_conv = dequantize_fp8_block(fp8.weight, fp8.scale)[:296]
    assert_close("fp8 copy math", act @ w_conv.t() + layer.bias, out.reshape(10, 296), RTOL[torch.float32])


def test_default_rule_keeps_cpu_and_w4a4_layers_on_nvfp4() -> None:
    layer, _ = _fused_layer(NvFp4Scheme(QuantAlgo.NVFP4))
    assert not layer.scheme.enable_fp8_blocks(layer)  # CPU resolves the "ref" backend: never faster
    assert layer.nvfp4_fp8 is None
    w4a4, _ = _fused_layer(NvFp4Scheme(QuantAlgo.NVFP4, w4a4=True, fp8_choice=lambda *a: True))
    assert not w4a4.scheme.enable_fp8_blocks(w4a4, backend="ref")


def test_enable_before_processing_is_an_error() -> None:
    layer = ReplicatedLinear(128, 64, scheme=NvFp4Scheme(), params_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="process_after_loading"):
        layer.scheme.enable_fp8_blocks(layer, backend="ref")


def _nvfp4_checkpoint(d: Path) -> None:
    t: dict[str, torch.Tensor] = {}
    for prefix, (n, k) in {
        "model.layers.0.mlp.up_proj": (64, 512),  # K % 512 == 0: block _scaled_mm, M > 16 only
        "model.layers.0.mlp.down_proj": (512, 128),  # K = 128: not trusted for _scaled_mm, stays NVFP4
    }.items():
        q = quantize_nvfp4(torch.randn(n, k))
        t[f"{prefix}.weight"] = q.weight
        t[f"{prefix}.weight_scale"] = q.weight_scale
        t[f"{prefix}.weight_scale_2"] = q.weight_scale_2.reshape(())
        t[f"{prefix}.input_scale"] = torch.tensor(1.0)
    save_file(t, str(d / "model.safetensors"))
    quant = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": []}
    (d / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant})
    )
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))


def test_inspect_shows_the_fp8_copy_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _nvfp4_checkpoint(tmp_path)
    up, down = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    plain = build_quant_plan(tmp_path, "cuda")
    assert plain.layer(up).implementation.startswith("kernels/nvfp4_gemm")
    opt = build_quant_plan(tmp_path, "cuda", nvfp4_as_fp8=True)
    assert opt.layer(up).implementation == nvfp4_fp8_implementation(64, 512)
    assert "M > 16, the NVFP4 kernels otherwise" in opt.layer(up).implementation
    assert opt.layer(down).implementation == plain.layer(down).implementation
    assert "M > 16" in str(
        nvfp4_fp8_implementation(7168, 7168)
    )  # M <= 16: the NVFP4 decode kernel won (run 8)
    # CPU runs its own quantized paths whatever the flag (no FP8 copy)
    cpu = build_quant_plan(tmp_path, "cpu", nvfp4_as_fp8=True)
    assert cpu.layer(up).implementation == build_quant_plan(tmp_path, "cpu").layer(up).implementation

    # the CLI flag reaches the plan (this CPU machine refuses --device cuda, so inspect runs for the CPU);
    # inspect validates a whole model (k3run.checks), so it runs on a complete NVFP4 checkpoint
    nvfp4 = Path(__file__).parents[1] / "fixtures" / "kimi_linear_nvfp4"
    assert cli_main(["inspect", str(nvfp4), "--device", "cpu", "--nvfp4-as-fp8"]) == 0
    assert "compiled loop if >= 1M weights, else dequantize + matmul" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["generate", "eval", "bench", "inspect"])
def test_cli_flag_is_off_by_default(cmd: str) -> None:
    argv = [cmd, "DIR"] + (["--prompt", "x"] if cmd == "generate" else [])
    assert build_parser().parse_args(argv).nvfp4_as_fp8 is False
    assert build_parser().parse_args([*argv, "--nvfp4-as-fp8"]).nvfp4_as_fp8 is True


def test_load_model_flag_is_a_no_op_on_cpu() -> None:
    from k3run.api import load_model

    d = Path(__file__).resolve().parents[1] / "fixtures" / "kimi_linear_nvfp4"
    if not (d / "model.safetensors").is_file():
        pytest.skip("ModelOpt fixture missing (tests/fixtures/make_fixtures.py)")
    model = load_model(d, dtype=torch.float32, nvfp4_as_fp8=True)
    nvfp4_layers = [m for m in model.modules() if isinstance(getattr(m, "scheme", None), NvFp4Scheme)]
    assert nvfp4_layers, "the fixture has NVFP4 linears"
    assert all(m.nvfp4_fp8 is None for m in nvfp4_layers)


@pytest.mark.gpu
def test_gpu_fp8_copy_runs_block_scaled_mm_for_large_m() -> None:
    """On sm90 the default rule converts a K = 7168 layer and runs it through block _scaled_mm for M > 16;
    M <= 16 on this small N*K stays on the NVFP4 kernel."""
    from k3run.kernels.fp8_gemm import blockwise_scaled_mm_supported

    if not blockwise_scaled_mm_supported(torch.device("cuda")):
        pytest.skip("block-scaled _scaled_mm needs sm90 and a CUDA >= 12.9 build of torch")
    k, n = 7168, 296
    t = checkpoint_tensors("nvfp4", torch.randn(n, k))
    layer = ReplicatedLinear(k, n, scheme=NvFp4Scheme(), params_dtype=torch.bfloat16)
    load_shards(layer, [t], merged=False)
    layer = layer.cuda()
    layer.process_after_loading()
    x_small = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    before = layer(x_small)
    assert layer.scheme.enable_fp8_blocks(layer)
    fp8 = layer.nvfp4_fp8
    assert fp8.backend == "scaled_mm"

    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    want = fp8_pb_wo_linear_ref(x.cpu(), fp8.weight.cpu(), fp8.scale.cpu(), n, None)
    # bf16 output: one rounding of the fp32 result (2^-9 relative) plus cuBLAS' fp32 accumulation order
    assert_close("fp8 copy on GPU", want.float(), out.float(), rtol=2**-8)
    # M = 8: the NVFP4 kernel as before (deterministic: split-K partials are summed without atomics)
    assert torch.equal(layer(x_small), before)
