"""Routed-expert picks sorted by expert on the device (torch only: the CPU loop imports it without Triton)."""

from __future__ import annotations

import torch


def sort_picks(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bucket, order, counts) of the picks ids [P] (int, a local expert per pick; outside [0, n_experts):
    another rank's): bucket [P] int64 the expert or n_experts for the misses, order [P] the stable sort of
    the picks by bucket (misses last, each expert's picks in increasing order), counts [n_experts] int64 the
    picks per expert. Device ops only: no host read-back."""
    ids = ids.long()
    bucket = torch.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    return bucket, torch.argsort(bucket, stable=True), counts[:n_experts]
