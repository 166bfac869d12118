"""Scheme numerics: FP8_PB_WO padding contract, NVFP4 exact fused global scales, W4A4 emulation, dispatch.

Tolerances: outputs are compared with fp32 references built from the same dequantized operands; the only
difference is the summation order of fp32 matmuls over K <= 512 terms (RMS error ~ sqrt(K) * 2^-24 ~ 1e-6
relative), so rtol = 1e-5 (fp32). Weight-level checks are bit-exact (torch.equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from k3run.formats import dequantize_nvfp4
from k3run.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from k3run.quant.algo import QuantAlgo
from k3run.quant.schemes import (
    Fp8PbWoScheme,
    NvFp4Scheme,
    OutputLayout,
    Segment,
    UnquantizedScheme,
    linear_scheme_for,
)
from k3run.testing import RTOL, assert_close
from tests.tp_utils import activation_reference, checkpoint_tensors, dequantized, load_shards


class RecordingGemm:
    """Stands in for the FP8 kernel: records its calls and returns a fixed 'physical' output."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.calls: list[dict] = []

    def __call__(self, x, weight, weight_scale, bias=None):  # type: ignore[no-untyped-def]
        self.calls.append({"x": x, "weight_shape": tuple(weight.shape), "bias": bias})
        return self.out.clone()


def test_fp8_pb_wo_hides_output_padding() -> None:
    """Port of upstream's contract: partitions [2048, 576], K = 128 -> N = 2624, padded to 2688."""
    physical = torch.randn(4, 2688)
    gemm = RecordingGemm(physical)
    layer = MergedColumnParallelLinear(
        128, [2048, 576], bias=True, scheme=Fp8PbWoScheme(gemm=gemm), params_dtype=torch.float32
    )
    assert tuple(layer.weight.shape) == (2624, 128)
    assert tuple(layer.weight_scale.shape) == (21, 1, 1, 1)
    ones = torch.ones(2624, 128).to(torch.float8_e4m3fn)
    layer.weight.weight_loader(layer.weight, ones[:2048], 0)
    layer.weight.weight_loader(layer.weight, ones[2048:], 1)
    layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(16, 1, 1, 1), 0)
    layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(5, 1, 1, 1), 1)
    bias = torch.randn(2624)
    layer.bias.weight_loader(layer.bias, bias[:2048], 0)
    layer.bias.weight_loader(layer.bias, bias[2048:], 1)
    assert layer.unfilled_parameters() == []
    layer.process_after_loading()

    assert tuple(layer.weight.shape) == (2688, 128)
    assert int(torch.count_nonzero(layer.weight[2624:].view(torch.uint8))) == 0
    assert bool((layer.weight[:2624].float() == 1.0).all())
    assert tuple(layer.weight_scale.shape) == (21, 1)

    x = torch.randn(4, 128)
    out = layer(x)
    assert len(gemm.calls) == 1
    assert gemm.calls[0]["bias"] is None
    assert gemm.calls[0]["weight_shape"] == (2688, 128)
    assert tuple(out.shape) == (4, 2624)
    assert out.is_contiguous()
    assert torch.equal(out, physical[:, :2624] + bias)


def test_fp8_pb_wo_without_padding_passes_bias_to_gemm() -> None:
    physical = torch.randn(3, 256)
    gemm = RecordingGemm(physical)
    layer = ReplicatedLinear(128, 256, bias=True, scheme=Fp8PbWoScheme(gemm=gemm), params_dtype=torch.float32)
    load_shards(layer, [checkpoint_tensors("fp8", torch.randn(256, 128)) | {"bias": torch.randn(256)}], False)
    layer.process_after_loading()
    out = layer(torch.randn(3, 128))
    assert gemm.calls[0]["bias"] is layer.bias
    assert torch.equal(out, physical)


def test_fp8_pb_wo_rejects_k_not_multiple_of_128() -> None:
    with pytest.raises(ValueError, match="divisible by 128, got 100"):
        ReplicatedLinear(100, 256, scheme=Fp8PbWoScheme(), prefix="blk.q_proj")


def test_fp8_pb_wo_numerics_match_reference() -> None:
    """Real GEMM with inner per-shard padding (96 -> 128) and final padding (200 -> 256)."""
    w = [torch.randn(96, 256), torch.randn(200, 256) * 3.0]
    tensors = [checkpoint_tensors("fp8", wi) for wi in w]
    layer = MergedColumnParallelLinear(256, [96, 200], scheme=Fp8PbWoScheme(), params_dtype=torch.float32)
    assert layer.weights.layout == OutputLayout(
        (96, 200), (Segment(0, 0, 96, 0), Segment(1, 0, 200, 128)), 328
    )
    load_shards(layer, tensors, merged=True)
    layer.process_after_loading()
    assert tuple(layer.weight.shape) == (384, 256)
    gap = torch.cat([layer.weight[96:128], layer.weight[328:]])
    assert int(torch.count_nonzero(gap.view(torch.uint8))) == 0
    x = torch.randn(2, 5, 256)  # leading dims are kept
    ref = activation_reference("fp8", x) @ torch.cat([dequantized("fp8", t) for t in tensors]).t()
    out = layer(x)
    assert tuple(out.shape) == (2, 5, 296)
    assert_close("fp8 merged", ref, out, rtol=RTOL[torch.float32])
    # bf16 activations: the scheme returns the activation dtype, one rounding of the fp32 result
    # (8 mantissa bits -> <= 2^-9 relative per element)
    out16 = layer(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    ref16 = (
        activation_reference("fp8", x.bfloat16()) @ torch.cat([dequantized("fp8", t) for t in tensors]).t()
    )
    assert_close("fp8 merged bf16", ref16, out16, rtol=2**-8)


def _nvfp4_merged(tensors: list[dict[str, torch.Tensor]], w4a4: bool = False) -> MergedColumnParallelLinear:
    sizes = [t["weight"].shape[0] for t in tensors]
    k = tensors[0]["weight"].shape[1] * 2
    layer = MergedColumnParallelLinear(
        k, sizes, scheme=NvFp4Scheme(QuantAlgo.NVFP4, w4a4=w4a4), params_dtype=torch.float32
    )
    load_shards(layer, tensors, merged=True)
    layer.process_after_loading()
    return layer


def _partition_dequant(layer: MergedColumnParallelLinear, p: int) -> torch.Tensor:
    o, s = layer.weights.layout.offsets[p], layer.weights.layout.sizes[p]
    return dequantize_nvfp4(layer.weight[o : o + s], layer.weight_scale[o : o + s], layer.weight_scale_2[p])


def test_nvfp4_w4a16_matches_dequantized_reference() -> None:
    w = torch.randn(80, 128)
    t = checkpoint_tensors("nvfp4", w)
    layer = ReplicatedLinear(128, 80, bias=True, scheme=NvFp4Scheme(), params_dtype=torch.float32)
    bias = torch.randn(80)
    load_shards(layer, [t | {"bias": bias}], merged=False)
    layer.process_after_loading()
    x = torch.randn(7, 128)
    assert_close("nvfp4 w4a16", x @ dequantized("nvfp4", t).t() + bias, layer(x), rtol=RTOL[torch.float32])


def test_nvfp4_fused_global_scales_unified_when_exact() -> None:
    """Shard 1 = shard 0's data scaled by 4: amax (so weight_scale_2) differs by exactly 4, every block
    scale of shard 0 can be divided by 4 in e4m3 without loss -> one global scale, bit-identical weights."""
    base = torch.randn(64, 128)
    tensors = [checkpoint_tensors("nvfp4", base), checkpoint_tensors("nvfp4", 4.0 * base)]
    assert tensors[1]["weight_scale_2"] == 4.0 * tensors[0]["weight_scale_2"]
    layer = _nvfp4_merged(tensors)
    ws2 = layer.weight_scale_2
    assert bool((ws2 == ws2[0]).all()), "exactly representable: expected one common global scale"
    assert ws2[0] == tensors[1]["weight_scale_2"]
    assert layer.nvfp4_weight.global_scale.tolist() == [ws2[0].item()]  # one scalar for the GEMM
    for p, t in enumerate(tensors):
        assert torch.equal(_partition_dequant(layer, p), dequantized("nvfp4", t)), f"partition {p} changed"
    x = torch.randn(5, 128)
    ref = x @ torch.cat([dequantized("nvfp4", t) for t in tensors]).t()
    assert_close("nvfp4 unified", ref, layer(x), rtol=RTOL[torch.float32])


def test_nvfp4_fused_global_scales_kept_per_partition_when_inexact() -> None:
    """Shards with unrelated amax: rescaling block scales would round, so each partition keeps its own
    global scale; 'take the max' (upstream) would change the weights, which the test also shows."""
    tensors = [
        checkpoint_tensors("nvfp4", torch.randn(48, 128)),
        checkpoint_tensors("nvfp4", 3.7 * torch.randn(80, 128)),
    ]
    s0, s1 = tensors[0]["weight_scale_2"], tensors[1]["weight_scale_2"]
    layer = _nvfp4_merged(tensors)
    assert layer.weight_scale_2.tolist() == [s0.item(), s1.item()]
    # the GEMM gets one decode scale per output row: 48 rows of shard 0's, 80 of shard 1's
    assert layer.nvfp4_weight.global_scale.tolist() == [s0.item()] * 48 + [s1.item()] * 80
    for p, t in enumerate(tensors):
        assert torch.equal(_partition_dequant(layer, p), dequantized("nvfp4", t))
    upstream = dequantize_nvfp4(tensors[0]["weight"], tensors[0]["weight_scale"], torch.maximum(s0, s1))
    assert not torch.allclose(upstream, dequantized("nvfp4", tensors[0]), rtol=0.1)
    x = torch.randn(6, 128)
    ref = x @ torch.cat([dequantized("nvfp4", t) for t in tensors]).t()
    assert_close("nvfp4 per-partition", ref, layer(x), rtol=RTOL[torch.float32])


def test_nvfp4_w4a4_emulation_uses_each_partitions_input_scale() -> None:
    w = [torch.randn(32, 64), torch.randn(48, 64)]
    tensors = [checkpoint_tensors("nvfp4", w[0], input_scale=0.01), checkpoint_tensors("nvfp4", w[1], 0.003)]
    layer = _nvfp4_merged(tensors, w4a4=True)
    x = torch.randn(4, 64)
    ref = torch.cat(
        [activation_reference("nvfp4", x, t["input_scale"]) @ dequantized("nvfp4", t).t() for t in tensors],
        -1,
    )
    out = layer(x)
    assert_close("nvfp4 w4a4", ref, out, rtol=RTOL[torch.float32])
    # the activation really was quantized: weight-only output differs by NVFP4 activation error (~10%)
    w4a16 = x @ torch.cat([dequantized("nvfp4", t) for t in tensors]).t()
    assert not torch.allclose(out, w4a16, rtol=1e-2)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_nvfp4_rejects_non_positive_global_scale(bad: float) -> None:
    t = checkpoint_tensors("nvfp4", torch.randn(16, 32))
    t["weight_scale_2"] = torch.tensor(bad)
    layer = ReplicatedLinear(32, 16, scheme=NvFp4Scheme(), prefix="m.proj", params_dtype=torch.float32)
    load_shards(layer, [t], merged=False)
    with pytest.raises(ValueError, match=r"m\.proj\.weight_scale_2: scales must be finite and positive"):
        layer.process_after_loading()


def test_unquantized_scheme_uses_parameter_dtype() -> None:
    w = torch.randn(24, 40)
    layer = ReplicatedLinear(40, 24, scheme=UnquantizedScheme(), params_dtype=torch.bfloat16)
    load_shards(layer, [{"weight": w}], merged=False)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # bf16 weights and inputs, fp32 accumulation, one bf16 rounding of the output (2^-9 relative)
    assert_close("bf16 linear", x.float() @ w.bfloat16().float().t(), out, rtol=2**-8)


@dataclass(frozen=True)
class FakeConfig:
    """Duck-typed ModelOptConfig: resolve() answers from a dict of prefix -> algo."""

    table: dict

    def resolve(self, prefix: str, shards=()) -> QuantAlgo:  # type: ignore[no-untyped-def]
        return self.table.get(prefix, QuantAlgo.NONE)


def test_linear_scheme_for_dispatch() -> None:
    cfg = FakeConfig(
        {"a": QuantAlgo.FP8_PB_WO, "b": QuantAlgo.NVFP4, "c": QuantAlgo.W4A16_NVFP4, "d": QuantAlgo.FP8}
    )
    kw = {"params_dtype": torch.bfloat16}
    assert isinstance(linear_scheme_for(None, "x", **kw), UnquantizedScheme)
    assert isinstance(linear_scheme_for(cfg, "zz", **kw), UnquantizedScheme)
    assert isinstance(linear_scheme_for(cfg, "a", **kw), Fp8PbWoScheme)
    b = linear_scheme_for(cfg, "b", nvfp4_w4a4=True, **kw)
    assert isinstance(b, NvFp4Scheme) and b.w4a4 and b.has_input_scale
    c = linear_scheme_for(cfg, "c", nvfp4_w4a4=True, **kw)
    assert isinstance(c, NvFp4Scheme) and not c.w4a4 and not c.has_input_scale
    with pytest.raises(ValueError, match="d: quant_algo FP8 is not supported"):
        linear_scheme_for(cfg, "d", **kw)


def test_linear_scheme_for_real_modelopt_config() -> None:
    from k3run.quant.modelopt import load_quant_config

    cfg = load_quant_config(Path(__file__).parents[1] / "fixtures" / "llama_fp8_pb_wo")
    kw = {"params_dtype": torch.bfloat16}
    shards = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    s = linear_scheme_for(cfg, "model.layers.0.self_attn.qkv_proj", shards, **kw)
    assert isinstance(s, Fp8PbWoScheme)
    assert isinstance(linear_scheme_for(cfg, "lm_head", **kw), UnquantizedScheme)


def test_output_layout_segments() -> None:
    # aligned starts: one segment per partition, each non-final partition padded to 128
    assert OutputLayout.build([64, 200], 128, [128, 0]).segments == (
        Segment(0, 0, 64, 0),
        Segment(1, 0, 200, 128),
    )
    # a partition that starts mid-block (checkpoint row 36) and ends inside that block: one segment
    assert OutputLayout.build([12, 30], 128, [36, 0]).segments == (
        Segment(0, 0, 12, 0),
        Segment(1, 0, 30, 128),
    )
    # starts at row 96 and crosses a block boundary: split at row 128 of the checkpoint
    layout = OutputLayout.build([100], 128, [96])
    assert layout.segments == (Segment(0, 0, 32, 0), Segment(0, 32, 68, 128))
    assert (layout.rows, layout.logical_rows, layout.contiguous) == (196, 100, False)
    # without alignment the row starts do not matter
    assert OutputLayout.build([100, 7], 1, [96, 3]).segments == (Segment(0, 0, 100, 0), Segment(1, 0, 7, 100))
    with pytest.raises(ValueError, match="output partition 1 has size 0"):
        OutputLayout.build([4, 0])
