"""Arithmetic helpers that round the same on every device."""

from __future__ import annotations

import torch


def div_exact(t: torch.Tensor, c: float) -> torch.Tensor:
    """Correctly rounded t / c on CPU and CUDA alike.

    PyTorch's CUDA kernel turns division by a Python scalar into multiplication by its reciprocal, which
    can differ in the last bit from a true division (what the CPU, and ModelOpt's CPU export, compute);
    dividing by a tensor on t's device keeps the IEEE division everywhere.
    """
    return t / torch.full((), c, dtype=t.dtype, device=t.device)
