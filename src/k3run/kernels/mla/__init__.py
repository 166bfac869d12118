"""Absorbed MLA decode attention for static (CUDA-graph) decode steps.

`mla_decode_attention` computes, per sequence, the softmax-weighted cached latents over positions
0 .. context_lens[b] of its slot. The reference (`ref.py`, fp32) gathers the attention window and masks it;
the Triton kernel (`triton.py`) reads only each sequence's real positions from the cache (split-context,
flash-decoding style), with no window copies.

On CUDA the kernel is the default (checked against the reference on an H200 and 4-14x faster than it at K3's
widths, bench/RESULTS.md); K3RUN_MLA_DECODE_KERNEL=0 selects the reference instead.
"""

from __future__ import annotations

import torch

from k3run.knobs import knobs

from .ref import mla_decode_ref


def decode_kernel_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and knobs().mla_decode_kernel


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    store: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """o_lat [B, H, L] fp32; see mla_decode_ref for the contract."""
    if decode_kernel_enabled(q_lat.device):
        from .triton import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, store, slots, context_lens, window, scale)
    return mla_decode_ref(q_lat, q_pe, store, slots, context_lens, window, scale)


__all__ = ["decode_kernel_enabled", "mla_decode_attention", "mla_decode_ref"]
