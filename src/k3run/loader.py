"""Streaming safetensors loading: each tensor goes straight to its parameter's weight loader.

Placeholder: filled in below by the streaming loader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch


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
