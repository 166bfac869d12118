"""Weight loaders of the parallel linears (single process): every parameter of every scheme, shapes, dtypes,
partial fills, clear errors. TP slicing and collectives are in test_linear_tp.py."""

from __future__ import annotations

import pytest
import torch

from k3run.distributed import TPInfo
from k3run.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from k3run.loader import InMemoryTensor
from k3run.quant.schemes import Fp8PbWoScheme, NvFp4Scheme, UnquantizedScheme
from k3run.testing import RTOL, assert_close
from tests.tp_utils import activation_reference, checkpoint_tensors, dequantized, load_shards, make_scheme

# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32: fp32 matmuls of the same operands, different summation order (see test_schemes.py)


@pytest.mark.parametrize("kind", ["none", "fp8", "nvfp4"])
def test_parameters_per_scheme(kind: str) -> None:
    layer = MergedColumnParallelLinear(256, [160, 96], scheme=make_scheme(kind), params_dtype=torch.float32)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()}
    expected = {
        "none": {"weight": ((256, 256), torch.float32)},
        # 160 rows -> the second partition starts at row 256 (its own 128-row block grid)
        "fp8": {"weight": ((352, 256), torch.float8_e4m3fn), "weight_scale": ((3, 1, 2, 1), torch.float32)},
        "nvfp4": {
            "weight": ((256, 128), torch.uint8),
            "weight_scale": ((256, 16), torch.float8_e4m3fn),
            "weight_scale_2": ((2,), torch.float32),
            "input_scale": ((2,), torch.float32),
        },
    }[kind]
    assert shapes == expected
    assert all(callable(p.weight_loader) for p in layer.parameters())


@pytest.mark.parametrize("kind", ["none", "fp8", "nvfp4"])
def test_merged_output_is_concatenation_of_shards(kind: str) -> None:
    w = [torch.randn(160, 256), torch.randn(96, 256)]
    tensors = [checkpoint_tensors(kind, wi) for wi in w]
    biases = [torch.randn(160), torch.randn(96)]
    layer = MergedColumnParallelLinear(
        256, [160, 96], bias=True, scheme=make_scheme(kind), params_dtype=torch.float32
    )
    load_shards(layer, [t | {"bias": b} for t, b in zip(tensors, biases, strict=True)], merged=True)
    assert layer.unfilled_parameters() == []
    layer.process_after_loading()
    x = torch.randn(5, 256)
    xa = activation_reference(kind, x)
    ref = torch.cat([xa @ dequantized(kind, t).t() + b for t, b in zip(tensors, biases, strict=True)], -1)
    out = layer(x)
    assert_close(f"{kind} merged", ref, out, rtol=RTOL[torch.float32])
    q, k = layer.split(out)
    assert q.shape[-1] == 160 and k.shape[-1] == 96


def test_unfilled_parameters_lists_missing_shards() -> None:
    layer = MergedColumnParallelLinear(128, [128, 64], scheme=NvFp4Scheme(), prefix="blk.fused")
    t = checkpoint_tensors("nvfp4", torch.randn(128, 128))
    load_shards(layer, [t], merged=True)
    assert layer.unfilled_parameters() == [
        "weight (shard 1)",
        "weight_scale (shard 1)",
        "weight_scale_2 (shard 1)",
        "input_scale (shard 1)",
    ]


def test_loading_twice_is_an_error() -> None:
    layer = ReplicatedLinear(32, 16, scheme=UnquantizedScheme(), prefix="p")
    w = torch.randn(16, 32)
    layer.weight.weight_loader(layer.weight, w)
    with pytest.raises(ValueError, match=r"p\.weight: loaded twice"):
        layer.weight.weight_loader(layer.weight, w)


def test_shape_mismatch_names_tensor_expected_and_actual() -> None:
    layer = ColumnParallelLinear(256, 384, scheme=Fp8PbWoScheme(), prefix="l.q_proj")
    q, s = checkpoint_tensors("fp8", torch.randn(384, 256)).values()
    with pytest.raises(
        ValueError, match=r"l\.q_proj\.weight: expected checkpoint shape \(384, 256\), got \(384, 128\)"
    ):
        layer.weight.weight_loader(layer.weight, q[:, :128])
    with pytest.raises(
        ValueError, match=r"l\.q_proj\.weight_scale: expected checkpoint shape \(3, 1, 2, 1\)"
    ):
        layer.weight_scale.weight_loader(layer.weight_scale, s[:2])


def test_dtype_mismatch_explains_quant_config_disagreement() -> None:
    fp8_layer = ReplicatedLinear(128, 64, scheme=Fp8PbWoScheme(), prefix="a")
    with pytest.raises(
        ValueError,
        match=r"a\.weight: expected dtype torch\.float8_e4m3fn, got torch\.bfloat16; .*"
        r"config quantizes it \[FP8_PB_WO",
    ):
        fp8_layer.weight.weight_loader(fp8_layer.weight, torch.randn(64, 128, dtype=torch.bfloat16))
    plain = ReplicatedLinear(128, 64, scheme=UnquantizedScheme(), prefix="b")
    fp8 = torch.randn(64, 128).to(torch.float8_e4m3fn)
    with pytest.raises(
        ValueError, match=r"b\.weight: expected dtype .*got torch\.float8_e4m3fn.*unquantized"
    ):
        plain.weight.weight_loader(plain.weight, fp8)
    nv = ReplicatedLinear(128, 64, scheme=NvFp4Scheme(), prefix="c")
    with pytest.raises(
        ValueError, match=r"c\.weight_scale: expected dtype torch\.float8_e4m3fn, got torch\.float32"
    ):
        nv.weight_scale.weight_loader(nv.weight_scale, torch.ones(64, 8))


def test_unquantized_weights_are_cast_from_any_float_dtype() -> None:
    layer = ReplicatedLinear(32, 16, scheme=UnquantizedScheme(), params_dtype=torch.float32)
    w = torch.randn(16, 32).bfloat16()
    layer.weight.weight_loader(layer.weight, w)
    assert torch.equal(layer.weight, w.float())


def test_nan_scalar_scales_are_rejected_by_the_layer() -> None:
    """Per-partition scalars are read on the CPU by the layer and checked there; weights and block scales
    are checked by load_checkpoint after the copy (tests/test_checks.py)."""
    nv = ReplicatedLinear(32, 16, scheme=NvFp4Scheme(), prefix="m")
    with pytest.raises(ValueError, match=r"m\.weight_scale_2: non-finite"):
        nv.weight_scale_2.weight_loader(nv.weight_scale_2, torch.tensor(float("nan")))


def test_per_partition_scalars_need_a_scalar() -> None:
    nv = MergedColumnParallelLinear(32, [16, 16], scheme=NvFp4Scheme(), prefix="m")
    with pytest.raises(ValueError, match=r"m\.input_scale \(shard 1\): expected a scalar .*got shape \(2,\)"):
        nv.input_scale.weight_loader(nv.input_scale, torch.ones(2), 1)
    nv.input_scale.weight_loader(nv.input_scale, torch.tensor([0.5]), 1)  # shape (1,) is a scalar too
    assert nv.input_scale[1] == 0.5


def test_shard_id_rules() -> None:
    merged = MergedColumnParallelLinear(32, [16, 16], scheme=UnquantizedScheme(), prefix="m")
    with pytest.raises(ValueError, match="a shard id is required"):
        merged.weight.weight_loader(merged.weight, torch.randn(16, 32))
    with pytest.raises(ValueError, match="shard id 2 out of range 0..1"):
        merged.weight.weight_loader(merged.weight, torch.randn(16, 32), 2)


def test_fp8_scalar_block_scale_for_single_tile() -> None:
    """ModelOpt squeezes a one-tile scale to shape (); it is accepted only when the shard is one tile."""
    w = torch.randn(96, 128)
    q, s = checkpoint_tensors("fp8", w).values()
    layer = ReplicatedLinear(128, 96, scheme=Fp8PbWoScheme(), params_dtype=torch.float32)
    load_shards(layer, [{"weight": q, "weight_scale": s.reshape(())}], merged=False)
    layer.process_after_loading()
    x = torch.randn(3, 128)
    ref = activation_reference("fp8", x) @ dequantized("fp8", {"weight": q, "weight_scale": s}).t()
    assert_close("fp8 scalar scale", ref, layer(x), rtol=RTOL[torch.float32])
    big = ReplicatedLinear(256, 96, scheme=Fp8PbWoScheme(), prefix="big")
    with pytest.raises(
        ValueError, match=r"big\.weight_scale: expected checkpoint shape \(1, 1, 2, 1\), got \(\)"
    ):
        big.weight_scale.weight_loader(big.weight_scale, torch.tensor(1.0))


def test_row_parallel_input_not_parallel_and_bias_once() -> None:
    w, b = torch.randn(24, 64), torch.randn(24)
    x = torch.randn(3, 64)
    full = ReplicatedLinear(64, 24, bias=True, scheme=UnquantizedScheme(), params_dtype=torch.float32)
    load_shards(full, [{"weight": w, "bias": b}], merged=False)
    parts = []
    for r in range(2):
        layer = RowParallelLinear(
            64,
            24,
            bias=True,
            input_is_parallel=False,
            reduce_results=False,
            tp=TPInfo(r, 2),
            scheme=UnquantizedScheme(),
            params_dtype=torch.float32,
        )
        load_shards(layer, [{"weight": w, "bias": b}], merged=False)
        parts.append(layer(x))
    # the bias is added on rank 0 only, so the reduction adds it once
    assert_close("row partial sums", full(x), parts[0] + parts[1], rtol=RTOL[torch.float32])
    assert_close("rank 1 has no bias", x[:, 32:] @ w[:, 32:].t(), parts[1], rtol=RTOL[torch.float32])


def test_loaders_accept_lazy_sources() -> None:
    """Loaders narrow a TensorSource before reading; an in-memory source records what was read."""

    class Recording(InMemoryTensor):
        reads: list = []

        def narrow(self, dim, start, length):  # type: ignore[no-untyped-def]
            return Recording(self.t.narrow(dim, start, length))

        def read(self):  # type: ignore[no-untyped-def]
            Recording.reads.append(tuple(self.t.shape))
            return self.t

    layer = ColumnParallelLinear(64, 96, tp=TPInfo(1, 4), scheme=UnquantizedScheme())
    layer.weight.weight_loader(layer.weight, Recording(torch.randn(96, 64)))
    assert Recording.reads == [(24, 64)]


def test_output_partition_must_split_evenly() -> None:
    with pytest.raises(
        ValueError, match=r"q: output partition 0 = 100 is not divisible by the tensor-parallel size 8"
    ):
        ColumnParallelLinear(64, 100, tp=TPInfo(0, 8), prefix="q", scheme=UnquantizedScheme())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_cuda_kernels_match_cpu_reference(kind: str) -> None:
    """The CUDA dispatch (k3run.kernels) against the CPU reference on the same checkpoint: rank 1 of 2 of a
    [192, 200] merged layer (FP8: both partitions start mid-block and are split into segments; NVFP4: the
    shards' global scales differ, so the kernel gets one decode scale per row). bf16 activations and output:
    the reference sees the same bf16 inputs in fp32, so the difference is the output rounding (2^-9) plus
    accumulation order; rtol 2^-8."""
    tensors = [
        checkpoint_tensors(kind, torch.randn(192, 256)),
        checkpoint_tensors(kind, 5 * torch.randn(200, 256)),
    ]
    x = torch.randn(37, 256).bfloat16()
    bias = torch.randn(392)
    outs = {}
    for device in ("cpu", "cuda"):
        with torch.device(device):
            layer = MergedColumnParallelLinear(
                256,
                [192, 200],
                bias=True,
                tp=TPInfo(1, 2),
                scheme=make_scheme(kind),
                params_dtype=torch.bfloat16,
            )
        load_shards(
            layer, [t | {"bias": b} for t, b in zip(tensors, (bias[:192], bias[192:]), strict=True)], True
        )
        layer.process_after_loading()
        assert layer.weight.device.type == device
        outs[device] = layer(x.to(device) if device == "cuda" else x.float())
    assert outs["cuda"].dtype == torch.bfloat16
    assert_close(f"{kind} cuda vs cpu", outs["cpu"], outs["cuda"].cpu(), rtol=2**-8)


@pytest.mark.parametrize("kind", ["none", "fp8", "nvfp4"])
def test_dequantized_weight_is_the_logical_rank_local_weight(kind: str) -> None:
    """Rank 1 of 2 of a [192, 200] merged layer: FP8 splits both partitions into segments, NVFP4 keeps two
    global scales; the dequantized weight is exactly the checkpoint's rows 96..191 and 100..199, before and
    after process_after_loading."""
    w = [torch.randn(192, 128), 7 * torch.randn(200, 128)]
    tensors = [checkpoint_tensors(kind, wi) for wi in w]
    ref = torch.cat([dequantized(kind, tensors[0])[96:], dequantized(kind, tensors[1])[100:]])
    layer = MergedColumnParallelLinear(
        128, [192, 200], tp=TPInfo(1, 2), scheme=make_scheme(kind), params_dtype=torch.float32
    )
    load_shards(layer, tensors, merged=True)
    assert torch.equal(layer.dequantized_weight(), ref)
    layer.process_after_loading()
    assert torch.equal(layer.dequantized_weight(), ref)


def test_small_cpu_fp8_layer_keeps_its_dequantized_weight() -> None:
    """A small FP8_PB_WO layer on the CPU decodes its weight once (kept on the layer) and gives the same bits
    as the reference decoding at every call; an in-place change of the weight is seen at the next call."""
    from k3run.quant.schemes import fp8_block_gemm_reference

    layer = MergedColumnParallelLinear(256, [160, 96], scheme=make_scheme("fp8"), params_dtype=torch.float32)
    load_shards(layer, [checkpoint_tensors("fp8", torch.randn(160, 256)),
                        checkpoint_tensors("fp8", torch.randn(96, 256))], merged=True)  # fmt: skip
    layer.process_after_loading()
    x = torch.randn(3, 256)

    def uncached() -> torch.Tensor:
        full = fp8_block_gemm_reference(x, layer.weight, layer.weight_scale)
        return torch.cat([full[:, :160], full[:, 256 : 256 + 96]], dim=-1)

    first = layer(x)
    assert "_cpu_dequantized" in layer.__dict__
    assert torch.equal(first, uncached()) and torch.equal(layer(x), first)
    with torch.no_grad():
        layer.weight.view(torch.uint8)[:, :128] = 0x38  # every code of the first 128 columns becomes 1.0
    assert torch.equal(layer(x), uncached()) and not torch.equal(layer(x), first)
