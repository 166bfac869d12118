"""Kimi Delta Attention ops: gate, q/k L2 norm, chunked prefill, recurrent decode and the short conv.

The dispatch point for every op is `_backend`; today it always answers "ref" (the fp32 torch oracle in
ref.py, which also runs on CUDA, slowly). The GPU kernels (fla's chunk_kda / fused_recurrent_kda and its
causal conv) are meant to be added as further branches there, keeping these signatures.
"""

from __future__ import annotations

import torch

from k3run.kernels.kda.ref import (
    CHUNK_SIZE,
    L2NORM_EPS,
    causal_conv1d_ref,
    chunk_kda_ref,
    kda_gate,
    l2norm,
    recurrent_kda_ref,
)

__all__ = [
    "CHUNK_SIZE",
    "L2NORM_EPS",
    "causal_conv1d",
    "chunk_kda",
    "kda_gate",
    "l2norm",
    "recurrent_kda",
]


def _backend(x: torch.Tensor) -> str:
    """Which implementation runs for inputs living where `x` lives."""
    del x  # one implementation today; GPU kernels will branch on x.device here
    return "ref"


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen KDA for prefill (chunks of 64).

    q, k [T, H, K] L2-normalised; v [T, H, V]; g [T, H, K] fp32 log decay; beta [T, H] post-sigmoid;
    initial_state [B, H, K, V] fp32 or None; cu_seqlens [B+1]. Returns o [T, H, V] fp32 and final states
    [B, H, K, V] fp32.
    """
    if _backend(q) == "ref":
        return chunk_kda_ref(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    raise AssertionError("unreachable: unknown KDA backend")


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen KDA token by token (decode); same contract as chunk_kda."""
    if _backend(q) == "ref":
        return recurrent_kda_ref(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    raise AssertionError("unreachable: unknown KDA backend")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU with conv states; x [T, C], weight [C, W], states [B, C, W-1]."""
    if _backend(x) == "ref":
        return causal_conv1d_ref(x, weight, cu_seqlens, initial_state)
    raise AssertionError("unreachable: unknown KDA backend")
