"""The three linear quantization schemes: create parameters, process them after loading, apply.

A scheme owns the *numerics* of one linear layer; the layer (layers/linear.py) owns tensor parallelism and
the weight loaders. Parameters are plain `torch.nn.Parameter`s named as the checkpoint names them
(`weight`, `weight_scale`, `weight_scale_2`, `input_scale`); next to each, the scheme records a `ParamSpec`
saying how the parameter's dims map onto the logical weight [N, K], which is all a loader needs to slice a
checkpoint tensor for any TP rank and fused shard.

Rows of fused output shards ("partitions") are laid out by `OutputLayout`. FP8_PB_WO starts every partition
(and every piece of a partition that begins mid-way through a checkpoint block on this TP rank) on a 128-row
boundary, so each 128x128 scale block covers rows of exactly one checkpoint block; the padding rows are zero
and `apply` crops them, so callers always see the concatenation of the logical partitions.

Each scheme has exactly one GEMM entry point (`self.gemm`, default `fp8_block_gemm` / `nvfp4_gemm`), where
the device is dispatched: CUDA tensors go to k3run.kernels, CPU tensors to fp32 references built on
k3run.formats (the oracles the kernels are tested against):
- Unquantized: `F.linear` in the parameter dtype (the activation dtype), on every device.
- FP8_PB_WO: activations fp8-quantized per token and 128-column group, both operands dequantized to fp32,
  fp32 matmul, one cast to the activation dtype.
- NVFP4: weights dequantized exactly to fp32 (optionally the activation quant-dequantized to NVFP4 for W4A4
  emulation), fp32 matmul, one cast to the activation dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from k3run.quant.algo import QuantAlgo

if TYPE_CHECKING:
    from k3run.kernels.nvfp4_gemm import NvFp4Weight
    from k3run.layers.linear import LinearBase
    from k3run.quant.modelopt import QuantConfig

FP8_BLOCK = 128
NVFP4_GROUP = 16
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter's dims map onto the logical weight [N rows, K columns] of its layer.

    out_dim / in_dim: the parameter dim that indexes output rows / input columns (None: not indexed by it).
    out_block / in_block: logical rows / columns per element along that dim: 1 for a weight, 2 for packed
      E2M1 bytes, 16 for NVFP4 group scales, 128 for FP8 block scales. Counts round up (edge blocks exist).
    per_partition: a [#partitions] vector holding one checkpoint scalar per fused shard.
    exact_dtype: the checkpoint tensor must have exactly the parameter dtype (quantized data and scales);
      otherwise any float dtype is accepted and cast (unquantized weights, biases).
    """

    out_dim: int | None
    in_dim: int | None
    out_block: int = 1
    in_block: int = 1
    per_partition: bool = False
    exact_dtype: bool = True


@dataclass(frozen=True)
class Segment:
    """Consecutive logical rows of one partition stored consecutively in the physical weight."""

    partition: int
    start: int  # first row within the partition's rank-local rows
    length: int
    physical: int  # first physical row


@dataclass(frozen=True)
class OutputLayout:
    """Rank-local rows of the fused output partitions inside the physical weight.

    sizes: logical rows of each partition on this rank. segments: where those rows live, in logical order.
    rows: physical rows of the registered weight (the last segment is not padded at registration).

    With `align` > 1 (FP8 128-row blocks) every segment starts on an aligned physical row, and a partition
    whose first local row is not on a checkpoint block boundary (`row_starts`, e.g. rank 1 of a 192-row
    shard at tp 2 starts at checkpoint row 96) is split there, so each physical block holds rows of exactly
    one checkpoint block and keeps that block's scale.
    """

    sizes: tuple[int, ...]
    segments: tuple[Segment, ...]
    rows: int

    @staticmethod
    def build(sizes: Sequence[int], align: int = 1, row_starts: Sequence[int] | None = None) -> OutputLayout:
        starts = tuple(row_starts) if row_starts is not None else (0,) * len(sizes)
        if len(starts) != len(sizes):
            raise ValueError(f"row_starts has {len(starts)} entries for {len(sizes)} partitions")
        pieces: list[tuple[int, int, int]] = []
        for i, (s, r) in enumerate(zip(sizes, starts, strict=True)):
            if s <= 0:
                raise ValueError(f"output partition {i} has size {s}; partitions must be positive")
            head = min(s, -r % align) if align > 1 else 0
            if head:
                pieces.append((i, 0, head))
            if s > head:
                pieces.append((i, head, s - head))
        segments, pos = [], 0
        for k, (i, start, length) in enumerate(pieces):
            segments.append(Segment(i, start, length, pos))
            pos += length if k == len(pieces) - 1 else _round_up(length, align)
        return OutputLayout(tuple(int(s) for s in sizes), tuple(segments), pos)

    @property
    def logical_rows(self) -> int:
        return sum(self.sizes)

    @property
    def contiguous(self) -> bool:
        """True when the logical rows follow each other without padding rows in between."""
        return self.rows == self.logical_rows

    @property
    def offsets(self) -> tuple[int, ...]:
        """Physical first row of each partition."""
        first: dict[int, int] = {}
        for seg in self.segments:
            first.setdefault(seg.partition, seg.physical)
        return tuple(first[i] for i in range(len(self.sizes)))

    def partition_segments(self, partition: int) -> tuple[Segment, ...]:
        return tuple(seg for seg in self.segments if seg.partition == partition)

    def partition_rows(self, partition: int) -> slice:
        """Physical rows of a partition stored in one segment (always the case without alignment)."""
        (seg,) = self.partition_segments(partition)
        return slice(seg.physical, seg.physical + seg.length)


@dataclass
class LinearWeights:
    """What `create_weights` registered: the row layout and the spec of every parameter by name."""

    input_size: int
    layout: OutputLayout
    params: dict[str, ParamSpec] = field(default_factory=dict)


@runtime_checkable
class LinearScheme(Protocol):
    def create_weights(
        self,
        layer: LinearBase,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        row_starts: Sequence[int] | None = None,
    ) -> LinearWeights: ...

    def process_after_loading(self, layer: LinearBase) -> None: ...

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def dequantize_weight(self, layer: LinearBase) -> torch.Tensor: ...

    def describe(self) -> str: ...


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _add_param(
    layer: LinearBase,
    weights: LinearWeights,
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: ParamSpec,
) -> None:
    # torch.empty: the loader tracks what was filled, so no sentinel value is needed
    param = torch.nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False)
    layer.register_parameter(name, param)
    weights.params[name] = spec


def _replace_param(layer: LinearBase, name: str, value: torch.Tensor) -> None:
    setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))


def _check_float_dtype(what: str, dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: expected bfloat16, float16 or float32, got {dtype}")


def _check_input(layer: LinearBase, x: torch.Tensor) -> None:
    k = layer.weights.input_size
    if x.shape[-1] != k:
        raise ValueError(f"{layer.prefix}: input has {x.shape[-1]} features, the layer expects {k}")


def _logical_rows(layer: LinearBase, w: torch.Tensor) -> torch.Tensor:
    """Physical weight rows -> the concatenated logical partitions (drops padding rows)."""
    layout: OutputLayout = layer.weights.layout
    if layout.contiguous:
        return w[: layout.logical_rows]
    return torch.cat([w[seg.physical : seg.physical + seg.length] for seg in layout.segments])


def _crop(layer: LinearBase, y: torch.Tensor) -> torch.Tensor:
    """Physical output columns -> the concatenated logical partitions (drops every padding column)."""
    layout: OutputLayout = layer.weights.layout
    if layout.contiguous:
        return y[..., : layout.logical_rows].contiguous()
    parts = [y[..., seg.physical : seg.physical + seg.length] for seg in layout.segments]
    return torch.cat(parts, dim=-1)


class UnquantizedScheme:
    """bf16 / fp16 / fp32 weights; `F.linear` in the parameter dtype."""

    algo = QuantAlgo.NONE

    def __init__(self, gemm: Callable[..., torch.Tensor] | None = None) -> None:
        self.gemm = gemm if gemm is not None else F.linear

    def create_weights(
        self,
        layer: LinearBase,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        row_starts: Sequence[int] | None = None,
    ) -> LinearWeights:
        _check_float_dtype(f"{getattr(layer, 'prefix', '')}: params_dtype", params_dtype)
        layout = OutputLayout.build(output_partition_sizes)
        w = LinearWeights(input_size_per_partition, layout)
        _add_param(
            layer,
            w,
            "weight",
            (layout.rows, input_size_per_partition),
            params_dtype,
            ParamSpec(out_dim=0, in_dim=1, exact_dtype=False),
        )
        return w

    def process_after_loading(self, layer: LinearBase) -> None:
        return None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_input(layer, x)
        if self.gemm is F.linear and x.dtype == torch.bfloat16:
            from k3run.kernels import cpu_simd

            if cpu_simd.bf16_gemv_applies(x, layer.weight):  # CPU decode: torch's bf16 GEMV is slow there
                y = cpu_simd.bf16_gemv(x.reshape(-1, x.shape[-1]), layer.weight)
                if bias is not None:
                    y = y + bias.float()
                return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
        return self.gemm(x, layer.weight, bias)

    def dequantize_weight(self, layer: LinearBase) -> torch.Tensor:
        """The rank-local logical weight [N, K] in fp32."""
        return layer.weight.float()

    def describe(self) -> str:
        return "unquantized (F.linear in the parameter dtype)"


def fp8_block_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The FP8_PB_WO GEMM over the whole physical weight: [M, K] x fp8 [N_phys, K] -> [M, N_phys].

    The one place a device kernel is chosen: CUDA runs k3run.kernels.fp8_gemm (block-wise cuBLAS on sm90,
    else Triton); the CPU its compiled loops on large matrices (kernels/fp8_gemm/cpu.py); everything else
    the k3run.formats reference below.
    """
    if x.is_cuda:
        from k3run.kernels.fp8_gemm import fp8_pb_wo_linear

        return fp8_pb_wo_linear(x, weight, weight_scale, weight.shape[0], bias)
    if x.device.type == "cpu":
        from k3run.kernels import cpu_fused

        if cpu_fused.applies(weight.shape[0], weight.shape[1]):
            from k3run.kernels.fp8_gemm.cpu import fp8_pb_wo_linear_cpu

            return fp8_pb_wo_linear_cpu(x, weight, weight_scale, weight.shape[0], bias)
    return fp8_block_gemm_reference(x, weight, weight_scale, bias)


def fp8_block_gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    dequantized: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = dq(q_x) @ dq(W)^T (+ bias) with dynamic per-token 1x128 fp8 activations; fp32 math, x.dtype out.

    x: [M, K]; weight: fp8 [N, K]; weight_scale: fp32 [ceil(N/128), K/128]. Returns [M, N]. dequantized:
    dq(W) already made (fp32 [N, K], the same values), as `_cpu_dequantized` keeps for small CPU layers.
    """
    from k3run.formats import dequantize_fp8_act_1x128, dequantize_fp8_block, quantize_fp8_act_1x128

    xq, xs = quantize_fp8_act_1x128(x)
    xd = dequantize_fp8_act_1x128(xq, xs).float()
    wd = dequantize_fp8_block(weight, weight_scale).float() if dequantized is None else dequantized
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _cpu_fast_path(weight: torch.Tensor) -> bool:
    """Whether a CPU FP8_PB_WO GEMM over `weight` takes kernels/fp8_gemm/cpu.py (large matrices)."""
    from k3run.kernels import cpu_fused

    return cpu_fused.applies(weight.shape[0], weight.shape[1])


def _cpu_dequantized(layer: LinearBase) -> torch.Tensor:
    """The fp32 dequantized weight of a small CPU FP8_PB_WO layer, made once and kept on the layer while its
    weight and scale tensors are the same objects, unchanged (their storage and in-place version counters):
    the reference GEMM then gives the same bits without decoding the weight at every call (a small model's
    decode step is otherwise mostly these decodes)."""
    from k3run.formats import dequantize_fp8_block

    kept = layer.__dict__.get("_cpu_dequantized")
    if (
        kept is not None and torch.compiler.is_compiling()
    ):  # a compiled step reads the copy it was traced with
        return kept[1]
    w, s = layer.weight, layer.weight_scale
    key = (w.data_ptr(), w._version, tuple(w.shape), s.data_ptr(), s._version, tuple(s.shape))
    kept = layer.__dict__.get("_cpu_dequantized")
    if kept is None or kept[0] != key:
        kept = (key, dequantize_fp8_block(w.detach(), s.detach()).float())
        layer.__dict__["_cpu_dequantized"] = kept
    return kept[1]


class Fp8PbWoScheme:
    """ModelOpt FP8_PB_WO: fp8 e4m3 weights with fp32 128x128 block scales; activations quantized
    dynamically per token and 128-column group.

    Registered at the logical size (weight fp8 [rows, K], weight_scale fp32 [ceil(rows/128), 1, K/128, 1]);
    after loading the weight is padded with exact zero rows to a multiple of 128 and the scale squeezed to
    [rows/128, K/128]. The GEMM runs on the padded weight without bias; the output is cropped to the logical
    partitions and made contiguous before the bias is added.
    """

    algo = QuantAlgo.FP8_PB_WO

    def __init__(self, gemm: Callable[..., torch.Tensor] | None = None) -> None:
        self.gemm = gemm if gemm is not None else fp8_block_gemm

    def create_weights(
        self,
        layer: LinearBase,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        row_starts: Sequence[int] | None = None,
    ) -> LinearWeights:
        prefix = getattr(layer, "prefix", "")
        _check_float_dtype(f"{prefix}: params_dtype", params_dtype)
        k = input_size_per_partition
        if k % FP8_BLOCK != 0:
            raise ValueError(
                f"{prefix}: FP8_PB_WO needs the input size per partition to be divisible by {FP8_BLOCK}, "
                f"got {k} (only the output dimension is padded)"
            )
        layout = OutputLayout.build(output_partition_sizes, align=FP8_BLOCK, row_starts=row_starts)
        w = LinearWeights(k, layout)
        _add_param(layer, w, "weight", (layout.rows, k), FP8_DTYPE, ParamSpec(out_dim=0, in_dim=1))
        _add_param(
            layer,
            w,
            "weight_scale",
            (math.ceil(layout.rows / FP8_BLOCK), 1, k // FP8_BLOCK, 1),
            torch.float32,
            ParamSpec(out_dim=0, in_dim=2, out_block=FP8_BLOCK, in_block=FP8_BLOCK),
        )
        return w

    def process_after_loading(self, layer: LinearBase) -> None:
        layout: OutputLayout = layer.weights.layout
        weight: torch.Tensor = layer.weight
        padded_rows = _round_up(layout.rows, FP8_BLOCK)
        if padded_rows != layout.rows or not layout.contiguous:
            # fresh zeros: every row outside a logical partition is exactly 0, whatever the registration held
            phys = torch.zeros(padded_rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            for seg in layout.segments:
                rows = slice(seg.physical, seg.physical + seg.length)
                phys[rows] = weight[rows]
            _replace_param(layer, "weight", phys)
        scale: torch.Tensor = layer.weight_scale
        _replace_param(layer, "weight_scale", scale.reshape(scale.shape[0], scale.shape[2]).contiguous())

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_input(layer, x)
        layout: OutputLayout = layer.weights.layout
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        direct = layout.contiguous and layout.rows == layer.weight.shape[0]
        gemm = self.gemm
        if gemm is fp8_block_gemm and x2.device.type == "cpu" and not _cpu_fast_path(layer.weight):
            gemm = functools.partial(fp8_block_gemm_reference, dequantized=_cpu_dequantized(layer))
        if direct:
            y = gemm(x2, layer.weight, layer.weight_scale, bias)
        else:
            y = _crop(layer, gemm(x2, layer.weight, layer.weight_scale, None))
            if bias is not None:
                y.add_(bias)
        return y.reshape(*lead, y.shape[-1])

    def dequantize_weight(self, layer: LinearBase) -> torch.Tensor:
        """The rank-local logical weight [N, K] in fp32 (before or after process_after_loading)."""
        from k3run.formats import dequantize_fp8_block

        return _logical_rows(layer, dequantize_fp8_block(layer.weight, layer.weight_scale))

    def describe(self) -> str:
        return "FP8_PB_WO (fp8 e4m3 weights, 128x128 fp32 block scales, dynamic 1x128 fp8 activations)"


# The NVFP4 -> FP8 choice (`--nvfp4-as-fp8`, opt-in): the one place it is made. H200 measurements,
# bench/RESULTS.md:
# - large M: the converted FP8 weight through block-scaled _scaled_mm runs 7168x7168 at M = 4096 in 0.400 ms
#   against 0.642 ms for NVFP4's dequantize + cuBLAS bf16 (1.51x cuBLAS bf16), and bare block _scaled_mm
#   reaches 1127-1138 TFLOP/s at M = 4096 on 7168x7168 and 2112x7168 against 724-745 for cuBLAS bf16, so it
#   wins at every large-M shape it accepts.
# - M <= 16: the Gluon NVFP4 decode kernel beats the FP8 copy: 7168x7168 in 0.0180 ms at M = 1 and
#   0.0232 ms at M = 16, against 0.0255 ms (M = 1) and 0.0242 ms (M = 16) through FP8 (the split128 Triton
#   decode kernel takes 0.0418 / 0.0681 ms). So FP8 is never picked there.
# - M = 17..64: the Gluon kernel's 32-token tile takes 0.037-0.039 ms on 7168x7168 at 17..32 rows and the
#   sm_90 wgmma GEMM 0.035 ms at 64, against the FP8 layer's ~0.029 ms at M = 64, so FP8 keeps every M > 16
#   (the wgmma GEMM's 0.027 ms at 32 rows has not been timed against the FP8 layer at 32).
# - only the block-scaled _scaled_mm backend: the Triton FP8 fallback runs at 589 TFLOP/s at M = 4096, below
#   dequantize + cuBLAS (702-739 TFLOP/s).
NVFP4_DECODE_MAX_M = 16  # up to here the NVFP4 decode kernel beats the FP8 copy (measurements above)


def nvfp4_fp8_faster(m: int, n: int, k: int, fp8_backend: str) -> bool:
    """Whether an NVFP4 linear [N, K] converted to FP8 blocks runs M rows faster on `fp8_backend` (the
    fp8_gemm backend the layer resolved at load) than the NVFP4 kernels do; see the measurements above."""
    if fp8_backend != "scaled_mm":
        return False
    return m > NVFP4_DECODE_MAX_M


@dataclass(frozen=True)
class Fp8BlockCopy:
    """An NVFP4 layer's weight re-quantized to FP8 128x128 blocks at load time (opt-in, lossy).

    weight: fp8 [N_pad, K] with zero pad rows; scale: fp32 [N_pad/128, K/128]; n: logical rows;
    backend: the fp8_gemm backend resolved for the layer's device and K.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    n: int
    backend: str


def nvfp4_gemm(x: torch.Tensor, weight: NvFp4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The NVFP4 GEMM: x [M, K] @ dq(W)^T (+ bias) -> [M, N] in x's dtype.

    The one place a device kernel is chosen (k3run.kernels.nvfp4_gemm): W4A16 kernels on CUDA, and on CPU
    its fp32 reference, which dequantizes with k3run.formats (e2m1 * block scale exact in fp32, one
    rounding for the per-row global scale) and multiplies in fp32.
    """
    from k3run.kernels.nvfp4_gemm import nvfp4_linear

    return nvfp4_linear(x, weight, bias)


class NvFp4Scheme:
    """ModelOpt NVFP4: packed E2M1 weights [N, K/2], fp8 e4m3 group-16 scales [N, K/16], one fp32 global
    decode scale per fused partition (`weight_scale_2`, [#partitions]) and, for NVFP4 checkpoints, one
    activation scale per partition (`input_scale`).

    Default: weight-only (W4A16) as on Hopper. `w4a4=True` emulates the Blackwell W4A4 path by NVFP4
    quant-dequantizing the activation with the partition's `input_scale` before the GEMM.

    Fused partitions with different `weight_scale_2` stay exact: after loading, a partition's block scales
    are rescaled to a common global scale only when re-dequantizing proves it bit-identical; otherwise each
    partition keeps its own global scale and is applied to its own output columns.

    Opt-in FP8 path (`enable_fp8_blocks`, load_model(nvfp4_as_fp8=True)): a second copy of the weight in FP8
    128x128 blocks, used for the calls where `fp8_choice(M, N, K, backend)` (default `nvfp4_fp8_faster`)
    says it is faster; the NVFP4 weight stays for the others.
    """

    def __init__(
        self,
        algo: QuantAlgo = QuantAlgo.NVFP4,
        w4a4: bool = False,
        gemm: Callable[..., torch.Tensor] | None = None,
        fp8_choice: Callable[[int, int, int, str], bool] | None = None,
    ) -> None:
        if algo not in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4):
            raise ValueError(f"NvFp4Scheme: algo must be NVFP4 or W4A16_NVFP4, got {algo}")
        if w4a4 and algo is not QuantAlgo.NVFP4:
            raise ValueError(
                "NvFp4Scheme: W4A4 emulation needs input_scale, which only NVFP4 checkpoints have"
            )
        self.algo = algo
        self.w4a4 = w4a4
        self.has_input_scale = algo is QuantAlgo.NVFP4
        self.gemm = gemm if gemm is not None else nvfp4_gemm
        self.fp8_choice = fp8_choice if fp8_choice is not None else nvfp4_fp8_faster

    def create_weights(
        self,
        layer: LinearBase,
        input_size_per_partition: int,
        output_partition_sizes: Sequence[int],
        params_dtype: torch.dtype,
        row_starts: Sequence[int] | None = None,
    ) -> LinearWeights:
        prefix = getattr(layer, "prefix", "")
        _check_float_dtype(f"{prefix}: params_dtype", params_dtype)
        k = input_size_per_partition
        if k % NVFP4_GROUP != 0:
            raise ValueError(
                f"{prefix}: NVFP4 needs the per-partition input size divisible by {NVFP4_GROUP}, got {k}"
            )
        layout = OutputLayout.build(output_partition_sizes)
        n_parts = len(layout.sizes)
        w = LinearWeights(k, layout)
        _add_param(layer, w, "weight", (layout.rows, k // 2), torch.uint8, ParamSpec(0, 1, in_block=2))
        _add_param(
            layer,
            w,
            "weight_scale",
            (layout.rows, k // NVFP4_GROUP),
            FP8_DTYPE,
            ParamSpec(0, 1, in_block=NVFP4_GROUP),
        )
        _add_param(
            layer, w, "weight_scale_2", (n_parts,), torch.float32, ParamSpec(None, None, per_partition=True)
        )
        if self.has_input_scale:
            _add_param(
                layer, w, "input_scale", (n_parts,), torch.float32, ParamSpec(None, None, per_partition=True)
            )
        return w

    def process_after_loading(self, layer: LinearBase) -> None:
        from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight

        layout: OutputLayout = layer.weights.layout
        ws2: torch.Tensor = layer.weight_scale_2
        _check_positive_scales(layer.prefix, "weight_scale_2", ws2)
        if self.has_input_scale:
            _check_positive_scales(layer.prefix, "input_scale", layer.input_scale)
        if len(layout.sizes) > 1 and not bool((ws2 == ws2[0]).all()):
            unified = _unify_global_scales(layer.weight, layer.weight_scale, ws2, layout)
            if unified is not None:
                new_scale, common = unified
                _replace_param(layer, "weight_scale", new_scale)
                _replace_param(layer, "weight_scale_2", torch.full_like(ws2, common))
                ws2 = layer.weight_scale_2
        if bool((ws2 == ws2[0]).all()):
            global_scale = ws2[:1]
        else:
            # one decode scale per output row: each partition keeps its own, applied to its own columns
            global_scale = torch.cat(
                [ws2[p].expand(layout.sizes[p]) for p in range(len(layout.sizes))]
            ).contiguous()
        # kernel layout, prepared once (on CPU it aliases the checkpoint tensors)
        try:
            layer.nvfp4_weight = prepare_nvfp4_weight(layer.weight, layer.weight_scale, global_scale)
        except ValueError as e:  # name the layer (the kernel layout checks the block scales)
            raise ValueError(f"{layer.prefix}: {e}") from None
        layer.nvfp4_act_groups = self._activation_groups(layer)
        layer.nvfp4_fp8 = None

    def enable_fp8_blocks(self, layer: LinearBase, backend: str | None = None) -> bool:
        """Add the FP8 128x128-block copy of the weight (after process_after_loading) if `fp8_choice` would
        use it for some M on this layer's device; returns whether it did.

        backend: the fp8_gemm backend to run it on (default: fp8_gemm.default_backend for the weight's device
        and K). W4A4 emulation and K not divisible by 128 keep the NVFP4 path only.
        """
        from k3run.kernels.fp8_gemm import default_backend
        from k3run.kernels.nvfp4_gemm import nvfp4_to_fp8_block

        if not hasattr(layer, "nvfp4_weight"):
            raise RuntimeError(f"{layer.prefix}: enable_fp8_blocks needs process_after_loading() first")
        k: int = layer.weights.input_size
        n: int = layer.weights.layout.rows
        if self.w4a4 or k % FP8_BLOCK:
            return False
        backend = backend or default_backend(layer.weight.device, k)
        if not any(self.fp8_choice(m, n, k, backend) for m in (1, NVFP4_DECODE_MAX_M + 1)):
            return False
        gs = layer.nvfp4_weight.row_global_scale.reshape(-1, 1)
        weight, scale = nvfp4_to_fp8_block(layer.weight, layer.weight_scale, gs)
        layer.nvfp4_fp8 = Fp8BlockCopy(weight=weight, scale=scale, n=n, backend=backend)
        return True

    def _activation_groups(self, layer: LinearBase) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """W4A4: partitions sharing one input_scale share one activation quant-dequant. Each group is
        (a partition holding the group's input_scale, the group's partitions); read once after loading so
        `apply` never synchronises with the device."""
        n = len(layer.weights.layout.sizes)
        if not self.w4a4:
            return ((0, tuple(range(n))),)
        groups: dict[float, list[int]] = {}
        for p, v in enumerate(layer.input_scale.tolist()):
            groups.setdefault(v, []).append(p)
        return tuple((ps[0], tuple(ps)) for ps in groups.values())

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_input(layer, x)
        layout: OutputLayout = layer.weights.layout
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        fp8: Fp8BlockCopy | None = layer.nvfp4_fp8
        if fp8 is not None and self.fp8_choice(x2.shape[0], fp8.n, x2.shape[1], fp8.backend):
            from k3run.kernels.fp8_gemm import fp8_pb_wo_linear

            y = fp8_pb_wo_linear(x2, fp8.weight, fp8.scale, fp8.n, bias, backend=fp8.backend)
            return y.reshape(*lead, fp8.n)
        groups: tuple[tuple[int, tuple[int, ...]], ...] = layer.nvfp4_act_groups
        if len(groups) == 1:
            y = self.gemm(self._activation(layer, x2, groups[0][0]), layer.nvfp4_weight, bias).to(x.dtype)
        else:
            # partitions quantized their activations with different input scales: one GEMM per scale,
            # each keeping its own partitions' columns (emulation only; K3 uses input_scale 1 throughout)
            y = torch.empty(x2.shape[0], layout.rows, dtype=x.dtype, device=x.device)
            for first, parts in groups:
                full = self.gemm(self._activation(layer, x2, first), layer.nvfp4_weight, bias)
                for p in parts:
                    rows = layout.partition_rows(p)
                    y[:, rows] = full[:, rows]
        return y.reshape(*lead, y.shape[-1])

    def _activation(self, layer: LinearBase, x: torch.Tensor, partition: int) -> torch.Tensor:
        if not self.w4a4:
            return x
        from k3run.formats import nvfp4_qdq

        xq = nvfp4_qdq(x.float(), layer.input_scale[partition])
        # CPU keeps the quant-dequantized values in fp32 (exact); the CUDA kernel takes 16-bit inputs, exact
        # when input_scale is a power of two (e2m1 * e4m3 has <= 6 significant bits)
        return xq if not x.is_cuda else xq.to(x.dtype)

    def dequantize_weight(self, layer: LinearBase) -> torch.Tensor:
        """The rank-local logical weight [N, K] in fp32, each partition with its own global scale."""
        from k3run.formats import dequantize_nvfp4

        layout: OutputLayout = layer.weights.layout
        parts = []
        for p in range(len(layout.sizes)):
            rows = layout.partition_rows(p)
            parts.append(
                dequantize_nvfp4(layer.weight[rows], layer.weight_scale[rows], layer.weight_scale_2[p])
            )
        return torch.cat(parts)

    def describe(self) -> str:
        mode = "W4A4 emulation (activations NVFP4 quant-dequantized)" if self.w4a4 else "weight-only W4A16"
        return f"{self.algo.value} (E2M1 weights, e4m3 group-16 scales, fp32 global scale; {mode})"


def enable_nvfp4_fp8_blocks(model: torch.nn.Module) -> list[str]:
    """The load-time NVFP4 -> FP8 conversion for every NVFP4 linear of a loaded model where the rule can
    pick it (load_model(nvfp4_as_fp8=True)); returns the prefixes converted. Routed experts (layers/moe)
    are not linears with a scheme and keep their NVFP4 path."""
    from k3run.layers.linear import LinearBase  # here: layers.linear imports this module

    done = []
    for module in model.modules():
        if not isinstance(module, LinearBase):
            continue
        scheme = module.scheme
        if isinstance(scheme, NvFp4Scheme) and scheme.enable_fp8_blocks(module):
            done.append(module.prefix)
    return done


def _check_positive_scales(prefix: str, name: str, t: torch.Tensor) -> None:
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        idx = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{prefix}.{name}: scales must be finite and positive, got {t[idx].item()} at partition {idx}"
        )


def _unify_global_scales(
    weight: torch.Tensor, weight_scale: torch.Tensor, ws2: torch.Tensor, layout: OutputLayout
) -> tuple[torch.Tensor, float] | None:
    """Try to express every partition with one global scale without changing a single dequantized bit.

    For each candidate common scale g (the partitions' own values, largest first), partition p's block
    scales become fp8(bs_p * ws2_p / g); the candidate is accepted only if dequantizing every partition with
    (new scales, g) reproduces (old scales, ws2_p) bit for bit. Returns (new weight_scale, g) or None.
    """
    from k3run.formats import dequantize_nvfp4

    for g in sorted(set(ws2.tolist()), reverse=True):
        common = torch.tensor(g, dtype=torch.float32, device=ws2.device)
        new_scale = weight_scale.clone()
        ok = True
        for p in range(len(layout.sizes)):
            if ws2[p].item() == g:
                continue
            rows = layout.partition_rows(p)
            old = weight_scale[rows]
            cand = (old.float() * (ws2[p] / common)).to(FP8_DTYPE)
            ref = dequantize_nvfp4(weight[rows], old, ws2[p])
            if not torch.equal(dequantize_nvfp4(weight[rows], cand, common), ref):
                ok = False
                break
            new_scale[rows] = cand
        if ok:
            return new_scale, g
    return None


def linear_scheme_for(
    qcfg: QuantConfig | None,
    prefix: str,
    shards: Sequence[str] = (),
    *,
    params_dtype: torch.dtype,
    nvfp4_w4a4: bool = False,
) -> LinearScheme:
    """The scheme of the linear layer `prefix` (fused from the checkpoint layers `shards`, if any)."""
    _check_float_dtype(f"{prefix}: params_dtype", params_dtype)
    algo = QuantAlgo.NONE if qcfg is None else qcfg.resolve(prefix, shards)
    if algo is QuantAlgo.NONE:
        return UnquantizedScheme()
    if algo is QuantAlgo.FP8_PB_WO:
        return Fp8PbWoScheme()
    if algo in (QuantAlgo.NVFP4, QuantAlgo.W4A16_NVFP4):
        return NvFp4Scheme(algo, w4a4=nvfp4_w4a4 and algo is QuantAlgo.NVFP4)
    if algo is QuantAlgo.MXFP4:
        raise ValueError(
            f"{prefix}: the quantization config makes this linear layer MXFP4; k3run reads MXFP4 "
            "(compressed-tensors) only for routed experts, which it casts to NVFP4 at load"
        )
    raise ValueError(
        f"{prefix}: quant_algo {algo.value} is not supported for linear layers "
        "(supported: FP8_PB_WO, NVFP4, W4A16_NVFP4, or unquantized)"
    )
