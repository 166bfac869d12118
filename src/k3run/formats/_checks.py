"""Input validation shared by the format modules and kernel wrappers: every failure names the tensor,
expected and actual."""

from __future__ import annotations

import torch


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        want = " or ".join(str(d) for d in allowed)
        raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")


def check_float(name: str, t: torch.Tensor) -> None:
    """A floating tensor with only finite values (NaN/Inf would silently become garbage codes)."""
    check_dtype(name, t, (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    if t.numel() and not torch.compiler.is_compiling() and not bool(torch.isfinite(t).all()):
        n_bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name}: expected finite values, got {n_bad} NaN/Inf of {t.numel()}")


def check_min_dims(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() < ndim:
        raise ValueError(f"{name}: expected at least {ndim} dims, got shape {tuple(t.shape)}")


def check_divisible(name: str, size: int, group: int, what: str) -> None:
    if size % group != 0:
        raise ValueError(f"{name}: {what} must be a multiple of {group}, got {size}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")
