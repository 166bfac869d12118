"""Absorbed MLA decode attention for static (CUDA-graph) decode steps.

`mla_decode_attention` computes, per sequence, the softmax-weighted cached latents over positions
0 .. context_lens[b] of its slot. The reference (`ref.py`, fp32) gathers the attention window and masks it;
the Triton kernel (`triton.py`) reads only each sequence's real positions from the cache (split-context,
flash-decoding style), with no window copies.

The kernel is EXPERIMENTAL and off by default: it passes its interpreter tests but has not run on a GPU
yet. Set K3RUN_MLA_DECODE_KERNEL=1 to use it on CUDA.
"""

from __future__ import annotations

import os

import torch

from .ref import mla_decode_ref


def decode_kernel_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("K3RUN_MLA_DECODE_KERNEL") == "1"


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
