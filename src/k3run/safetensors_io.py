"""Safetensors checkpoints without surprises: headers read and validated before any tensor data is touched.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section) plus an optional
`"__metadata__"` string map, then the raw data. Reading only the header lets `k3run inspect` and the quant
plan describe a multi-terabyte checkpoint in milliseconds, and checking the offsets against the file size
turns a truncated download into an error that names the file and the first tensor it cuts, instead of an
mmap fault halfway through loading.

A checkpoint is a single `.safetensors` file, or a directory holding `model.safetensors.index.json` (whose
`weight_map` must agree with the shard headers), else `model.safetensors`, else all its `.safetensors` files.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"

# The safetensors reference implementation refuses headers above 100 MB; a larger length is a corrupt file.
MAX_HEADER_BYTES = 100_000_000

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_CODES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file or index that is truncated, corrupt or inconsistent."""


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code such as "BF16" or "F8_E4M3"."""
    try:
        return _DTYPES[code]
    except KeyError:
        known = ", ".join(_DTYPES)
        raise CheckpointError(f"unsupported safetensors dtype {code!r}; known: {known}") from None


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype (the inverse of `torch_dtype`)."""
    try:
        return _CODES[dtype]
    except KeyError:
        raise CheckpointError(f"torch dtype {dtype} has no safetensors code") from None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a header describes it; no data loaded."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    data_offsets: tuple[int, int]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class FileHeader:
    path: Path
    tensors: dict[str, TensorInfo]  # in data-offset order
    metadata: dict[str, str]


def _itemsize(code: str) -> int:
    return torch.empty((), dtype=torch_dtype(code)).element_size()


def _parse_entry(path: Path, name: str, entry: object, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry must be an object, got {type(entry).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {', '.join(missing)}")
    code = entry["dtype"]
    if not isinstance(code, str) or code not in _DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {code!r}; known: {', '.join(_DTYPES)}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    offs = entry["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end], got {offs!r}")
    begin, end = offs
    expected = math.prod(shape) * _itemsize(code)
    if begin < 0 or end - begin != expected:
        raise CheckpointError(
            f"{where}: data_offsets {offs} hold {end - begin} bytes, expected {expected} "
            f"for {code} {tuple(shape)}"
        )
    if end > data_len:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} needs data bytes [{begin}, {end}) but the file has only "
            f"{data_len} data bytes"
        )
    return TensorInfo(name, code, tuple(shape), path, (begin, end))


def read_header(path: str | Path) -> FileHeader:
    """Parse and validate one file's header: dtypes, shapes, offsets within the file, no overlaps."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: truncated: {size} bytes, a safetensors file starts with an 8-byte header length"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: header length {n} exceeds {MAX_HEADER_BYTES}; not a safetensors file"
            )
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated: header needs {8 + n} bytes, the file has {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_len = size - 8 - n
    infos = [_parse_entry(path, name, entry, data_len) for name, entry in header.items()]
    infos.sort(key=lambda t: t.data_offsets)
    for prev, cur in zip(infos, infos[1:]):
        if cur.data_offsets[0] < prev.data_offsets[1]:
            raise CheckpointError(
                f"{path}: tensors {prev.name!r} {list(prev.data_offsets)} and {cur.name!r} "
                f"{list(cur.data_offsets)} overlap"
            )
    return FileHeader(path, {t.name: t for t in infos}, dict(metadata))


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (a file, a directory with an index, or a directory of shards)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_weight_map(index)
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: weight_map names shard files that do not exist: {missing}")
        return [path / f for f in files]
    # HF writes an unsharded checkpoint as model.safetensors; other .safetensors files next to it (a
    # consolidated copy, a test's source weights) are not part of it.
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files and no {INDEX_FILE}")
    return files


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    return weight_map


def read_checkpoint_headers(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint by name, from the headers only.

    Raises CheckpointError when a name appears in two shards, or when an index's weight_map and the shard
    headers disagree about which tensors live where.
    """
    path = Path(path)
    tensors: dict[str, TensorInfo] = {}
    for file in checkpoint_files(path):
        for name, info in read_header(file).tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].file} and {file}")
            tensors[name] = info
    index = path / INDEX_FILE if path.is_dir() else None
    if index is not None and index.is_file():
        weight_map = _read_weight_map(index)
        for name, fname in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fname} but no shard holds it")
            if tensors[name].file.name != Path(fname).name:
                stored = tensors[name].file.name
                raise CheckpointError(
                    f"{index}: tensor {name!r} is mapped to {fname} but is stored in {stored}"
                )
        extra = sorted(set(tensors) - set(weight_map))
        if extra:
            raise CheckpointError(f"{index}: shards hold tensors missing from weight_map: {extra[:5]}")
    return tensors


class CheckpointReader:
    """Random access to a checkpoint's tensors by name, opening each shard lazily and once.

    Use as a context manager; `get` loads one tensor (a copy in memory, the file stays mapped).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = read_checkpoint_headers(self.path)
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)  # type: ignore[attr-defined]
        self._handles.clear()

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(str(info.file), framework="pt", device="cpu")
            handle.__enter__()  # type: ignore[attr-defined]
            self._handles[info.file] = handle
        t = handle.get_tensor(name)  # type: ignore[attr-defined]
        if t.dtype != info.torch_dtype or tuple(t.shape) != info.shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} decoded as {t.dtype} {tuple(t.shape)}, header says "
                f"{info.dtype} {info.shape}"
            )
        return t


def iter_tensors(path: str | Path, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) file by file in on-disk order, one tensor in memory at a time."""
    wanted = None if names is None else set(names)
    with CheckpointReader(path) as reader:
        if wanted is not None:
            unknown = sorted(wanted - set(reader.tensors))
            if unknown:
                raise KeyError(f"{path}: no tensors named {unknown[:5]}")
        order = sorted(reader.tensors.values(), key=lambda t: (str(t.file), t.data_offsets))
        for info in order:
            if wanted is None or info.name in wanted:
                yield info.name, reader.get(info.name)
