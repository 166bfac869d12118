"""Tensor-parallel linear layers with weight loaders for every parameter of every scheme.

Layers own the parallel layout (which rows / columns of a checkpoint tensor this rank keeps) and the
collectives; the scheme (quant/schemes.py) owns the parameters' dtypes, shapes and the GEMM. A loader needs
nothing scheme-specific: each parameter's `ParamSpec` says which dim indexes output rows and input columns
and in which units (1 element, 2 packed E2M1 values, 16-wide NVFP4 groups, 128-wide FP8 blocks).

Sharding rules:
- Column-parallel: every output partition is split evenly over the ranks; rank r keeps rows
  [r*s, (r+1)*s) of each checkpoint shard (s = its local size). A *replicated* partition of a merged layer
  (KDA's f_a_proj) is declared with size s*tp, keeps s rows per rank and loads the whole checkpoint tensor on
  every rank.
- FP8 block scales along N: the scheme's layout starts a new 128-row physical block wherever the rank's
  rows cross a checkpoint block boundary, so each physical block takes exactly one checkpoint block scale.
  When the whole shard is one block (b_proj: 96 rows) every rank loads that block, which generalises
  upstream's "fewer row blocks than tp_size -> replicate"; shards like 192 rows at tp 2 (rank 1 starts at
  row 96) are split instead of refused.
- Row-parallel: K is split evenly; packed bytes, group-16 and 128-block scales are split in their own units.
- Per-partition scalars (NVFP4 weight_scale_2 / input_scale) go to their partition's slot.
Every (parameter, partition) must be loaded exactly once; `unfilled_parameters` lists what is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

import torch

from k3run.distributed import NO_TP, TPInfo, all_gather, all_reduce
from k3run.loader import InMemoryTensor, SliceLoader, TensorSource, check_finite
from k3run.quant.schemes import LinearScheme, LinearWeights, ParamSpec, linear_scheme_for

if TYPE_CHECKING:
    from k3run.kernels.nvfp4_gemm import NvFp4Weight
    from k3run.quant.modelopt import QuantConfig
    from k3run.quant.schemes import Fp8BlockCopy

ShardId = int | None
_BIAS_SPEC = ParamSpec(out_dim=0, in_dim=None, exact_dtype=False)
_UNQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class LinearOptions(TypedDict, total=False):
    """The keyword options every layer below passes through to `LinearBase`, which holds their defaults
    and documents them."""

    bias: bool
    qcfg: QuantConfig | None
    prefix: str
    tp: TPInfo
    params_dtype: torch.dtype
    shard_prefixes: Sequence[str]
    scheme: LinearScheme | None


class LinearBase(torch.nn.Module):
    """y = x W^T (+ b) over rank-local partitions; subclasses choose what is sharded and the collectives.

    output_sizes: the declared (global) output size of every fused partition, in order.
    shard_out / shard_in: whether output rows / input columns are split over the TP ranks.
    replicated: partitions kept whole on every rank (declared as local size * tp).
    qcfg / prefix / shard_prefixes: the scheme comes from `linear_scheme_for(qcfg, prefix, shard_prefixes)`
      unless `scheme` is given; `prefix` (checkpoint naming) also names the layer in every error.
    tp: this rank's place in the TP group; params_dtype: dtype of unquantized weights and the bias.
    """

    # The parameters a scheme registers (quant/schemes.py), under the checkpoint's names; which of them exist
    # depends on the scheme (every scheme has `weight`; FP8_PB_WO and NVFP4 `weight_scale`; NVFP4
    # `weight_scale_2` and, for NVFP4 checkpoints, `input_scale`).
    weight: torch.nn.Parameter
    weight_scale: torch.nn.Parameter
    weight_scale_2: torch.nn.Parameter
    input_scale: torch.nn.Parameter
    # NvFp4Scheme's state, set by its process_after_loading / enable_fp8_blocks
    nvfp4_weight: NvFp4Weight
    nvfp4_act_groups: tuple[tuple[int, tuple[int, ...]], ...]
    nvfp4_fp8: Fp8BlockCopy | None

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        shard_out: bool,
        shard_in: bool,
        replicated: Sequence[int] = (),
        bias: bool = False,
        qcfg: QuantConfig | None = None,
        prefix: str = "",
        tp: TPInfo = NO_TP,
        params_dtype: torch.dtype = torch.bfloat16,
        shard_prefixes: Sequence[str] = (),
        scheme: LinearScheme | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = tuple(int(s) for s in output_sizes)
        self.shard_out = shard_out
        self.shard_in = shard_in
        self.replicated = frozenset(replicated)
        self.params_dtype = params_dtype
        for i in self.replicated:
            if not 0 <= i < len(self.output_sizes):
                raise ValueError(
                    f"{prefix}: replicated partition {i} out of range 0..{len(self.output_sizes) - 1}"
                )
        size = tp.size if shard_out else 1
        self.local_output_sizes = tuple(
            _split(s, size, f"{prefix}: output partition {i}") for i, s in enumerate(self.output_sizes)
        )
        self.input_size_per_partition = _split(
            input_size, tp.size if shard_in else 1, f"{prefix}: input size"
        )
        self.scheme = (
            scheme
            if scheme is not None
            else linear_scheme_for(qcfg, prefix, tuple(shard_prefixes), params_dtype=params_dtype)
        )
        # the checkpoint row each partition's rank-local rows start at: block-scaled schemes split a
        # partition where it crosses a checkpoint block boundary
        row_starts = [self._source_row_start(i) for i in range(len(self.output_sizes))]
        self.weights: LinearWeights = self.scheme.create_weights(
            self, self.input_size_per_partition, self.local_output_sizes, params_dtype, row_starts=row_starts
        )
        if bias:
            self.register_parameter(
                "bias",
                torch.nn.Parameter(
                    torch.empty(sum(self.local_output_sizes), dtype=params_dtype), requires_grad=False
                ),
            )
        else:
            self.register_parameter("bias", None)
        for name, param in self.named_parameters(recurse=False):
            param.weight_loader = SliceLoader(self._loader_for(name))
        self._filled: set[tuple[str, int]] = set()

    @property
    def num_partitions(self) -> int:
        return len(self.output_sizes)

    def _spec(self, name: str) -> ParamSpec:
        return _BIAS_SPEC if name == "bias" else self.weights.params[name]

    def _loader_for(self, name: str) -> Callable[[torch.nn.Parameter, TensorSource, ShardId], None]:
        def load(param: torch.nn.Parameter, loaded: TensorSource, shard_id: ShardId = None) -> None:
            self._load(name, param, loaded, shard_id)

        return load

    def _partition(self, shard_id: ShardId) -> int:
        if shard_id is None:
            if self.num_partitions != 1:
                raise ValueError(
                    f"{self.prefix}: a shard id is required ({self.num_partitions} fused partitions)"
                )
            return 0
        if not isinstance(shard_id, int) or not 0 <= shard_id < self.num_partitions:
            raise ValueError(
                f"{self.prefix}: shard id {shard_id!r} out of range 0..{self.num_partitions - 1}"
            )
        return shard_id

    def _checkpoint_rows(self, part: int) -> int:
        """Rows of the checkpoint tensor feeding partition `part`."""
        if part in self.replicated:
            return self.local_output_sizes[part]
        return self.output_sizes[part]

    def _source_row_start(self, part: int) -> int:
        if not self.shard_out or part in self.replicated:
            return 0
        return self.tp.rank * self.local_output_sizes[part]

    def _expected_shape(self, spec: ParamSpec, param: torch.Tensor, part: int) -> tuple[int, ...]:
        shape = list(param.shape)
        if spec.out_dim is not None:
            shape[spec.out_dim] = math.ceil(self._checkpoint_rows(part) / spec.out_block)
        if spec.in_dim is not None:
            shape[spec.in_dim] = math.ceil(self.input_size / spec.in_block)
        return tuple(shape)

    def _load(self, name: str, param: torch.nn.Parameter, loaded: TensorSource, shard_id: ShardId) -> None:
        what = (f"{self.prefix}.{name}" if self.prefix else name) + (
            "" if shard_id is None else f" (shard {shard_id})"
        )
        part = self._partition(shard_id)
        if (name, part) in self._filled:
            raise ValueError(f"{what}: loaded twice")
        spec = self._spec(name)
        _check_dtype(what, spec, param, loaded.dtype, self.scheme)
        if spec.per_partition:
            if math.prod(loaded.shape) != 1:
                raise ValueError(
                    f"{what}: expected a scalar (shape () or (1,)), got shape {loaded.shape} "
                    f"[{self.scheme.describe()}]"
                )
            value = loaded.read().reshape(())
            check_finite(what, value)
            param.data[part] = value.to(param.device)
            self._filled.add((name, part))
            return
        expected = self._expected_shape(spec, param, part)
        src = loaded
        if len(loaded.shape) == 0 and math.prod(expected) == 1 and spec.out_block > 1:
            # ModelOpt squeezes a single-tile block scale to a 0-dim scalar
            src = InMemoryTensor(loaded.read().reshape(expected))
        if tuple(src.shape) != expected:
            raise ValueError(
                f"{what}: expected checkpoint shape {expected}, got {tuple(loaded.shape)} "
                f"(dtype {loaded.dtype}) [{self.scheme.describe()}]"
            )
        pieces = self._row_slices(what, spec, part) if spec.out_dim is not None else [None]
        for piece in pieces:
            part_src, dst = src, param.data
            if piece is not None and spec.out_dim is not None:
                dst_start, src_start, n = piece
                part_src = part_src.narrow(spec.out_dim, src_start, n)
                dst = dst.narrow(spec.out_dim, dst_start, n)
            if spec.in_dim is not None and self.shard_in and self.tp.size > 1:
                k_local = self.input_size_per_partition
                if k_local % spec.in_block != 0:
                    raise ValueError(
                        f"{what}: local input size {k_local} is not a multiple of {spec.in_block}"
                    )
                n_in = k_local // spec.in_block
                part_src = part_src.narrow(spec.in_dim, self.tp.rank * n_in, n_in)
            # values: load_checkpoint screens the parameter on its device after the copy (k3run.checks)
            dst.copy_(part_src.read().to(device=dst.device, dtype=dst.dtype))
        self._filled.add((name, part))

    def _row_slices(self, what: str, spec: ParamSpec, part: int) -> list[tuple[int, int, int]]:
        """(first destination element, first checkpoint element, count) along the output dim, per segment."""
        local = self.local_output_sizes[part]
        row0 = self._source_row_start(part)
        if spec is _BIAS_SPEC:
            # the bias holds the logical partitions back to back
            return [(sum(self.local_output_sizes[:part]), row0, local)]
        b = spec.out_block
        pieces = []
        for seg in self.weights.layout.partition_segments(part):
            first_row = row0 + seg.start
            if b == 1:
                pieces.append((seg.physical, first_row, seg.length))
                continue
            if seg.physical % b != 0:
                raise ValueError(f"{what}: segment starts at row {seg.physical}, not on a {b}-row boundary")
            # every physical block must hold rows of a single checkpoint block to keep its exact scale
            n_blocks = math.ceil(seg.length / b)
            for j in range(n_blocks):
                first, last = first_row + j * b, first_row + min((j + 1) * b, seg.length) - 1
                if first // b != last // b or first // b != first_row // b + j:
                    raise ValueError(
                        f"{what}: rank {self.tp.rank} rows {first}..{last} straddle checkpoint scale blocks "
                        f"{first // b} and {last // b}; the layout was built without this rank's row starts"
                    )
            pieces.append((seg.physical // b, first_row // b, n_blocks))
        return pieces

    def unfilled_parameters(self) -> list[str]:
        """Every (parameter, partition) that no loader call has filled yet, named relative to this module."""
        missing = []
        for name, _ in self.named_parameters(recurse=False):
            for part in range(self.num_partitions):
                if (name, part) not in self._filled:
                    shard = "" if self.num_partitions == 1 else f" (shard {part})"
                    missing.append(f"{name}{shard}")
        return missing

    def process_after_loading(self) -> None:
        self.scheme.process_after_loading(self)

    def dequantized_weight(self) -> torch.Tensor:
        """This rank's logical weight [sum(local_output_sizes), K/tp or K] in fp32, whatever the scheme
        (e.g. for MLA weight absorption); padding rows never appear."""
        return self.scheme.dequantize_weight(self)

    def _apply_scheme(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.scheme.apply(self, x, bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={list(self.local_output_sizes)}, tp={self.tp.rank}/"
            f"{self.tp.size}, scheme={self.scheme.describe()}"
        )


def _split(total: int, parts: int, what: str) -> int:
    if total % parts != 0:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def _check_dtype(
    what: str, spec: ParamSpec, param: torch.Tensor, dtype: torch.dtype, scheme: LinearScheme
) -> None:
    ok = dtype == param.dtype if spec.exact_dtype else dtype in _UNQUANTIZED_DTYPES
    if ok:
        return
    hint = ""
    if not spec.exact_dtype and (dtype in _FP8_DTYPES or dtype == torch.uint8):
        hint = "; the checkpoint holds quantized data but the quant config makes this layer unquantized"
    elif spec.exact_dtype and dtype in _UNQUANTIZED_DTYPES and param.dtype not in _UNQUANTIZED_DTYPES:
        hint = "; the checkpoint holds an unquantized tensor but the quantization config quantizes it"
    want = param.dtype if spec.exact_dtype else " or ".join(str(d) for d in _UNQUANTIZED_DTYPES)
    raise ValueError(f"{what}: expected dtype {want}, got {dtype}{hint} [{scheme.describe()}]")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (latent projections shared by all heads, routers)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        **options: Unpack[LinearOptions],
    ) -> None:
        super().__init__(
            input_size,
            [output_size],
            shard_out=False,
            shard_in=False,
            **options,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_scheme(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over the ranks; with gather_output the full output is all-gathered."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        gather_output: bool = False,
        **options: Unpack[LinearOptions],
    ) -> None:
        super().__init__(
            input_size,
            [output_size],
            shard_out=True,
            shard_in=False,
            **options,
        )
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._apply_scheme(x, self.bias)  # [..., N/tp]
        if self.gather_output:
            y = all_gather(y, self.tp, dim=-1)  # [..., N]
        return y


class MergedColumnParallelLinear(LinearBase):
    """Several checkpoint projections fused along N, each split over the ranks (shard id = position).

    The output is the rank-local concatenation [p0_local | p1_local | ...] (`local_output_sizes`); padding
    added by a scheme never shows. `replicated_shard_id` names a partition declared as (local size * tp)
    that every rank loads whole from its checkpoint tensor (KDA f_a_proj: every rank needs the whole latent).
    `shard_prefixes` (the checkpoint prefixes of the fused projections) let the quant config resolve the
    fused layer's scheme.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        replicated_shard_id: int | None = None,
        **options: Unpack[LinearOptions],
    ) -> None:
        replicated = () if replicated_shard_id is None else (replicated_shard_id,)
        super().__init__(
            input_size,
            output_sizes,
            shard_out=True,
            shard_in=False,
            replicated=replicated,
            **options,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_scheme(x, self.bias)  # [..., sum(local_output_sizes)]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rank-local output of each partition."""
        return tuple(torch.split(y, list(self.local_output_sizes), dim=-1))


class RowParallelLinear(LinearBase):
    """Input features split over the ranks; partial products are summed with an all-reduce (visible in
    `forward`). The bias is added once, on rank 0, before the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        **options: Unpack[LinearOptions],
    ) -> None:
        super().__init__(
            input_size,
            [output_size],
            shard_out=False,
            shard_in=True,
            **options,
        )
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            k = self.input_size_per_partition
            x = x.narrow(-1, self.tp.rank * k, k)  # [..., K/tp]
        y = self._apply_scheme(x, self.bias if self.tp.rank == 0 else None)
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        return y
