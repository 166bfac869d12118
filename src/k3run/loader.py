"""Streaming safetensors loading: every checkpoint tensor goes straight to its parameter's weight loader.

`load_checkpoint(model, path, mapping)` reads the headers (k3run.safetensors_io), asks the model's name
table (`mapping`) where each tensor goes, then streams the tensors one at a time in on-disk order. Data is
read with plain positioned reads into freshly allocated tensors (no mmap), and a loader that narrows a
`TensorSource` before `read()` (the parallel linears do) reads only the rows/columns its rank keeps. Peak
memory is therefore the final parameters plus one tensor in flight; tests/test_loader.py measures it.

Values are checked by k3run.checks, cheapest first: every small (fp32) scale tensor is read on the CPU and
checked before any weight is streamed; after the last tensor, every parameter must be filled (modules that
track partial fills, such as the fused linears, report their own gaps through `unfilled_parameters()`),
then every parameter is screened where it now lives (one reduction each, one host sync in all) for NaN /
Inf and invalid E4M3 block scales, a flagged one confirmed from its checkpoint tensors, and only then each
module's `process_after_loading()` runs (padding, scale unification, kernel layouts). Any of these
failures raises `checks.CheckpointInvalid` naming the checkpoint tensor, the value and its index.

`dry_run=True` runs the same mapping, loaders and completeness check on a model built on the meta device
with no tensor data read (what `k3run inspect` does).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from k3run.distributed import NO_TP, TPInfo

if TYPE_CHECKING:
    from k3run.safetensors_io import TensorInfo

# A rank that keeps some columns of a tensor reads each row's wanted bytes with its own positioned read
# when that run is at least _MIN_RUN_BYTES; shorter runs are cheaper to read as whole rows, in chunks of
# about _CHUNK_BYTES so the transient stays small.
_MIN_RUN_BYTES = 256
_CHUNK_BYTES = 16 << 20
_CHECK_CHUNK = 1 << 16  # elements per slice of the NaN/Inf check
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@runtime_checkable
class TensorSource(Protocol):
    """A tensor that may still be on disk: narrowing is free, `read()` materialises only what is left."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def narrow(self, dim: int, start: int, length: int) -> TensorSource: ...

    def read(self) -> torch.Tensor: ...


class InMemoryTensor:
    """`TensorSource` over a tensor already in memory (tests, custom loaders)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def narrow(self, dim: int, start: int, length: int) -> InMemoryTensor:
        return InMemoryTensor(self.t.narrow(dim, start, length))

    def read(self) -> torch.Tensor:
        return self.t


def as_source(x: torch.Tensor | TensorSource) -> TensorSource:
    return InMemoryTensor(x) if isinstance(x, torch.Tensor) else x


class SliceLoader:
    """Marks a weight loader that takes a `TensorSource`, so the checkpoint loader can hand it an unread
    tensor and only the slice this rank keeps is ever read. Called with a plain tensor it works as well."""

    def __init__(self, fn: Callable[[torch.nn.Parameter, TensorSource, Any], None]) -> None:
        self.fn = fn

    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor | TensorSource, shard_id: Any = None
    ) -> None:
        self.fn(param, as_source(loaded), shard_id)


class _ReadCounter:
    """Bytes read from disk, for the progress bar and for tests of per-rank slicing."""

    def __init__(self) -> None:
        self.bytes = 0


class FileTensor:
    """A tensor in a safetensors file, read on demand with positioned reads (only the narrowed region)."""

    def __init__(
        self,
        fd: int,
        offset: int,
        full_shape: tuple[int, ...],
        dtype: torch.dtype,
        counter: _ReadCounter,
        region: tuple[tuple[int, int], ...] | None = None,
    ) -> None:
        self.fd = fd
        self.offset = offset  # absolute byte offset of element 0 in the file
        self.full_shape = full_shape
        self._dtype = dtype
        self.counter = counter
        self.region = region if region is not None else tuple((0, n) for n in full_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.region)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def narrow(self, dim: int, start: int, length: int) -> FileTensor:
        dim = dim % len(self.region)
        s0, n0 = self.region[dim]
        if start < 0 or length < 0 or start + length > n0:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for size {n0}")
        region = list(self.region)
        region[dim] = (s0 + start, length)
        return FileTensor(self.fd, self.offset, self.full_shape, self._dtype, self.counter, tuple(region))

    def _pread_into(self, out: torch.Tensor, file_offset: int) -> None:
        self._pread_bytes(out.reshape(-1).view(torch.uint8).numpy(), file_offset)

    def _pread_bytes(self, buf: Any, file_offset: int) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], file_offset + done)
            if n <= 0:
                raise OSError(f"unexpected end of file at byte {file_offset + done}")
            done += n
        self.counter.bytes += len(view)

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self._dtype)
        if out.numel() == 0:
            return out
        item = out.element_size()
        full = self.full_shape
        narrowed = [
            d for d, ((s, n), f) in enumerate(zip(self.region, full, strict=True)) if (s, n) != (0, f)
        ]
        last = narrowed[-1] if narrowed else 0
        strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
        if last == 0:
            # a block of whole rows (or the whole tensor, or a scalar): one contiguous byte range
            start = self.region[0][0] * strides[0] if full else 0
            self._pread_into(out, self.offset + start * item)
            return out
        # dims after `last` are whole, so each index of dims 0..last-1 selects one contiguous run
        run = self.region[last][1] * strides[last]
        if run * item >= _MIN_RUN_BYTES:
            flat = out.reshape(-1).view(torch.uint8).numpy()
            pos = 0
            for idx in itertools.product(*(range(s, s + n) for s, n in self.region[:last])):
                elem = sum(i * st for i, st in zip(idx, strides, strict=False))
                elem += self.region[last][0] * strides[last]
                self._pread_bytes(flat[pos : pos + run * item], self.offset + elem * item)
                pos += run * item
            return out
        # short runs (e.g. a rank's columns of a small scale tensor): read bounded chunks of whole rows
        (r0, nr), rest = self.region[0], self.region[1:]
        rows_per_chunk = max(1, _CHUNK_BYTES // max(1, strides[0] * item))
        for a in range(0, nr, rows_per_chunk):
            b = min(nr, a + rows_per_chunk)
            chunk = torch.empty((b - a, *full[1:]), dtype=self._dtype)
            self._pread_into(chunk, self.offset + (r0 + a) * strides[0] * item)
            for d, (s, n) in enumerate(rest, start=1):
                chunk = chunk.narrow(d, s, n)
            out[a:b] = chunk
        return out


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter name of the model and the shard id for its loader."""

    param: str
    shard_id: Any = None


# A mapping returns the targets of a checkpoint tensor, IGNORE to skip it on purpose, or None when it does
# not know the name (an error).
IGNORE: tuple[Target, ...] = ()
NameMapping = Callable[[str], Sequence[Target | tuple[str, Any]] | None]


def identity_mapping(name: str) -> list[Target]:
    """Checkpoint names are parameter names (no fused layers)."""
    return [Target(name)]


@runtime_checkable
class TracksLoading(Protocol):
    """A module whose parameters are filled piecewise (fused shards) and knows which pieces are missing.

    `unfilled_parameters()` names them relative to the module, e.g. "weight_scale (shard 2)".
    """

    def unfilled_parameters(self) -> list[str]: ...


@runtime_checkable
class PostLoad(Protocol):
    def process_after_loading(self) -> None: ...


class LoadError(ValueError):
    """A checkpoint that does not fit the model: names the tensor, the parameter and what was expected."""


@dataclass(frozen=True)
class LoadStats:
    tensors: int  # checkpoint tensors loaded into at least one parameter
    ignored: int  # tensors the mapping skipped on purpose
    bytes_read: int  # bytes actually read from disk by this process for the parameters
    checked_bytes: int = 0  # bytes the scale-value check read before streaming (small fp32 scales)


def _scheme_note(model: torch.nn.Module, param_name: str) -> str:
    module_name = param_name.rpartition(".")[0]
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return ""
    scheme = getattr(module, "scheme", None)
    return f" [layer {module_name}: {scheme.describe()}]" if scheme is not None else ""


def _targets(mapping: NameMapping, name: str) -> list[Target] | None:
    raw = mapping(name)
    if raw is None:
        return None
    return [t if isinstance(t, Target) else Target(*t) for t in raw]


def _default_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if shard_id is not None:
        raise ValueError(f"a shard id ({shard_id!r}) needs a weight_loader; this parameter has none")
    if tuple(loaded.shape) != tuple(param.shape) or loaded.dtype != param.dtype:
        raise ValueError(
            f"expected {param.dtype} {tuple(param.shape)}, got {loaded.dtype} {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)  # values: load_checkpoint screens every parameter after the copy


def check_finite(what: str, t: torch.Tensor) -> None:
    """Raise on NaN/Inf, for small tensors a loader reads on the CPU (per-partition scalars). Works through
    the tensor in slices so the check never holds more than a small mask. Whole checkpoints are checked by
    load_checkpoint (k3run.checks), after the copy."""
    if not (t.is_floating_point() or t.dtype in _FP8_DTYPES):
        return
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        bad = _non_finite(flat[start : start + _CHECK_CHUNK])
        if bool(bad.any()):
            first = start + int(bad.nonzero()[0, 0])
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)) if t.dim() else ()
            total = int(_non_finite(flat).sum())
            raise ValueError(f"{what}: non-finite value (NaN/Inf) at index {idx} of {total} bad elements")


def _non_finite(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:
        return (x.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn has NaN only: S.1111.111
    if x.dtype == torch.float8_e5m2:
        return (x.view(torch.uint8) & 0x7F) >= 0x7C  # all-ones exponent: Inf or NaN
    return ~torch.isfinite(x)


def _data_start(path: Path) -> int:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


class _Sources:
    """Checkpoint tensors as loader sources: FileTensor reads from files opened once each (until close()),
    or, in a dry run, header-only stand-ins."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.counter = _ReadCounter()
        self._fds: dict[Path, tuple[int, int]] = {}

    def get(self, info: TensorInfo) -> TensorSource:
        if self.dry_run:
            return _HeaderTensor(info.shape, info.torch_dtype)
        if info.file not in self._fds:
            self._fds[info.file] = (os.open(info.file, os.O_RDONLY), _data_start(info.file))
        fd, start = self._fds[info.file]
        return FileTensor(fd, start + info.data_offsets[0], info.shape, info.torch_dtype, self.counter)

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _plan_tensors(
    model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter], infos: Mapping[str, TensorInfo],
    mapping: NameMapping, fail: Callable[[str], None],
) -> tuple[list[tuple[str, list[Target]]], int]:  # fmt: skip
    """(checkpoint tensor, its targets) in file order for every tensor the mapping sends somewhere, and how
    many it ignores; `fail` gets a message for each tensor that maps to a missing parameter and one for all
    the tensors with no destination."""
    plan: list[tuple[str, list[Target]]] = []
    unknown, ignored = [], 0
    for name, info in sorted(infos.items(), key=lambda kv: (str(kv[1].file), kv[1].data_offsets)):
        targets = _targets(mapping, name)
        if targets is None:
            unknown.append(name)
            continue
        if not targets:
            ignored += 1
            continue
        missing = [t for t in targets if t.param not in params]
        for t in missing:
            fail(
                f"checkpoint tensor {name!r} ({info.dtype} {list(info.shape)}) maps to parameter "
                f"{t.param!r}, which the model does not have{_scheme_note(model, t.param)}"
            )
        if not missing:
            plan.append((name, targets))
    if unknown:
        fail(
            f"{len(unknown)} checkpoint tensors have no destination in the model (not consumed): "
            f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    return plan, ignored


def _feed(
    param: torch.nn.Parameter, src: TensorSource, name: str, info: TensorInfo, t: Target, raising: bool
) -> str | None:
    """Give checkpoint tensor `name` to its target's weight loader: None when it took it, else the error
    message (raised as LoadError when `raising`)."""
    loader = getattr(param, "weight_loader", None)
    try:
        if isinstance(loader, SliceLoader):
            loader(param, src, t.shard_id)
        else:
            (loader or _default_loader)(param, src.read(), t.shard_id)
    except LoadError as e:
        if raising:
            raise
        return str(e)
    except (ValueError, RuntimeError, IndexError, OSError) as e:
        shard = "" if t.shard_id is None else f" shard {t.shard_id!r}"
        where = f"checkpoint tensor {name!r} ({info.dtype} {list(info.shape)}) -> parameter {t.param!r}"
        message = f"{where}{shard}: {e}"
        if raising:
            raise LoadError(message) from e
        return message
    return None


def load_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    mapping: NameMapping = identity_mapping,
    *,
    tp: TPInfo = NO_TP,
    progress: bool = True,
    ignore_unfilled: Iterable[str] = (),
    dry_run: bool = False,
    infos: Mapping[str, TensorInfo] | None = None,
) -> LoadStats:
    """Stream the checkpoint at `path` (a .safetensors file, or a directory with or without an index) into
    `model`, check values and completeness, then run every module's `process_after_loading`.

    mapping(name) -> [Target(param, shard_id), ...] | IGNORE | None. Parameters listed in `ignore_unfilled`
    (exact names) may stay unfilled (e.g. computed buffers registered as parameters). Only rank 0 shows a
    progress bar. dry_run: `model` lives on the meta device; no data is read (1-element tensors are given to
    the loaders as ones), values are not checked and nothing is post-processed; every per-tensor loader
    error is collected and raised together as checks.CheckpointInvalid. infos: the checkpoint's headers, when
    the caller has read them already (at ~1M tensors a read takes seconds).
    """
    from tqdm import tqdm

    from k3run.checks import CheckpointInvalid, Problem, scale_value_problems
    from k3run.safetensors_io import read_checkpoint_headers

    if infos is None:
        infos = read_checkpoint_headers(path)
    params = dict(model.named_parameters())
    errors: list[str] = []

    def fail(message: str) -> None:
        if not dry_run:
            raise LoadError(message)
        errors.append(message)

    plan, ignored = _plan_tensors(model, params, infos, mapping, fail)
    checked: dict[str, int] = {}
    if not dry_run:  # the small scales first: a zero or NaN scale is refused before any weight is read
        problems = scale_value_problems({n: infos[n] for n, _ in plan}, block_scales=False, stats=checked)
        if problems:
            raise CheckpointInvalid(path, problems)

    sources = _Sources(dry_run)
    touched: set[str] = set()
    total = sum(infos[n].nbytes for n, _ in plan)
    show = progress and tp.rank == 0 and not dry_run
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not show)
    try:
        for name, targets in plan:
            info = infos[name]
            src = sources.get(info)
            for t in targets:
                message = _feed(params[t.param], src, name, info, t, raising=not dry_run)
                if message is None:
                    touched.add(t.param)
                else:
                    errors.append(message)
            bar.update(info.nbytes)
    finally:
        bar.close()
        sources.close()

    try:
        _check_filled(model, params, touched, set(ignore_unfilled))
    except LoadError as e:
        fail(str(e))
    if dry_run:
        if errors:
            raise CheckpointInvalid(path, [Problem(" ".join(m.split())) for m in errors])
        return LoadStats(tensors=len(plan), ignored=ignored, bytes_read=0)
    _screen_values(path, params, touched, plan, infos)
    # children before their parents (reversed pre-order), so a container's post-processing (e.g. MLA
    # weight absorption) sees its linears already processed
    for module in reversed(list(model.modules())):
        if isinstance(module, PostLoad):
            module.process_after_loading()
    return LoadStats(
        tensors=len(plan),
        ignored=ignored,
        bytes_read=sources.counter.bytes,
        checked_bytes=checked.get("bytes", 0),
    )


def _screen_values(
    path: str | Path,
    params: dict[str, torch.nn.Parameter],
    touched: set[str],
    plan: list[tuple[str, list[Target]]],
    infos: Mapping[str, TensorInfo],
) -> None:
    """Every loaded parameter screened where it lives (checks.screen_parameters: one reduction each, one
    host sync); a flagged parameter is confirmed from the checkpoint tensors that fed it, read back on the
    CPU (only on this error path), so the error names the checkpoint tensor, the value and its index."""
    from k3run.checks import CheckpointInvalid, confirm_from_checkpoint, screen_parameters

    flagged = screen_parameters({n: params[n] for n in sorted(touched)})
    if not flagged:
        return
    feeds: dict[str, list[Any]] = {}
    for name, targets in plan:
        for t in targets:
            feeds.setdefault(t.param, []).append(infos[name])
    problems = confirm_from_checkpoint(flagged, feeds)
    if problems:
        raise CheckpointInvalid(path, problems)


class _HeaderTensor:
    """`TensorSource` of a dry run: the shape and dtype of a checkpoint tensor and no data (a meta tensor;
    a 1-element float tensor reads as ones, so loaders that take scalar scales see a valid value)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, full: int | None = None) -> None:
        self._shape, self._dtype = tuple(shape), dtype
        self.full = math.prod(shape) if full is None else full

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def narrow(self, dim: int, start: int, length: int) -> _HeaderTensor:
        dim = dim % len(self._shape)
        if start < 0 or length < 0 or start + length > self._shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for size {self._shape[dim]}")
        shape = list(self._shape)
        shape[dim] = length
        return _HeaderTensor(tuple(shape), self._dtype, self.full)

    def read(self) -> torch.Tensor:
        if self.full == 1 and self._dtype.is_floating_point and self._dtype.itemsize > 1:
            return torch.ones(self._shape, dtype=self._dtype)
        return torch.empty(self._shape, dtype=self._dtype, device="meta")


def _check_filled(
    model: torch.nn.Module, params: dict[str, torch.nn.Parameter], touched: set[str], allowed: set[str]
) -> None:
    missing: list[str] = []
    tracked: set[str] = set()
    module: torch.nn.Module  # torch leaves named_modules() unannotated (Any)
    for module_name, module in model.named_modules():
        if isinstance(module, TracksLoading):
            prefix = f"{module_name}." if module_name else ""
            tracked.update(prefix + n for n, _ in module.named_parameters(recurse=False))
            missing += [prefix + item for item in module.unfilled_parameters()]
    missing += [n for n in params if n not in tracked and n not in touched]
    missing = [m for m in missing if m.split(" ")[0] not in allowed]
    if missing:
        raise LoadError(
            f"{len(missing)} parameters were not filled by the checkpoint: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
