"""K3 block attention residuals (AttnRes).

Instead of one running residual sum, K3 keeps the completed "block" vectors of each token (block 0 is the
token embedding; a new block closes every `attn_res_block_size` layers) plus the running sum `prefix` of the
sub-layer outputs of the current block. Each sub-layer input is a softmax mix over those candidates:

    k_n = cand_n * rsqrt(mean(cand_n^2) + eps)        (RMS-normalised, no weight)
    p   = softmax_n(k_n . (w_norm * w_proj))           (one score per candidate and token)
    out = sum_n p_n * cand_n                           (mix of the un-normalised candidates)

All mixing math is fp32 and the result is cast back to the activation dtype once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from k3run.kernels.norm import attn_res_mix as kernel_attn_res_mix
from k3run.layers.norm import norm_weight_loader


def attn_res_mix(
    cands: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix candidates [T, D] each with the pseudo-query w_norm * w_proj; returns [T, D] in cands' dtype."""
    if not cands:
        raise ValueError("attn_res_mix: needs at least one candidate")
    d = cands[0].shape[-1]
    if norm_weight.numel() != d or proj_weight.numel() != d:
        raise ValueError(
            f"attn_res_mix: weights must have {d} elements, got norm {tuple(norm_weight.shape)}, "
            f"proj {tuple(proj_weight.shape)}"
        )
    query = norm_weight.float().reshape(d) * proj_weight.float().reshape(d)  # [D]
    return kernel_attn_res_mix(cands, query, eps)  # one Triton launch (plus the stack) on CUDA


class AttnResWeights(nn.Module):
    """The two vectors of one AttnRes site, named as the checkpoint names them.

    `<site>_res_norm.weight` [D] and `<site>_res_proj.weight` [1, D] (a Linear D -> 1 without bias, the
    pseudo-query). Replicated on every TP rank.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.proj_weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=params_dtype), requires_grad=False)
        for p in (self.norm_weight, self.proj_weight):
            p.weight_loader = norm_weight_loader  # type: ignore[attr-defined]

    def forward(self, cands: list[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(cands, self.norm_weight, self.proj_weight, self.eps)


@dataclass
class AttnResState:
    """The residual state carried from layer to layer: closed blocks and the open block's running sum."""

    blocks: list[torch.Tensor] = field(default_factory=list)  # each [T, D], activation dtype
    prefix: torch.Tensor | None = None  # [T, D] or None right after a block closed

    def candidates(self) -> list[torch.Tensor]:
        if self.prefix is None:
            raise RuntimeError("AttnResState: the open block is empty (no sub-layer output yet)")
        return [*self.blocks, self.prefix]

    def add(self, out: torch.Tensor) -> None:
        # The running sum stays in the activation dtype, as the reference rounds it.
        self.prefix = out if self.prefix is None else self.prefix + out


def attn_res_layer(
    state: AttnResState,
    layer_idx: int,
    block_size: int,
    mixer: Callable[[torch.Tensor], torch.Tensor],
    mlp: Callable[[torch.Tensor], torch.Tensor],
    attn_site: AttnResWeights,
    mlp_site: AttnResWeights,
) -> None:
    """One K3 decoder layer on `state` (in place). `mixer(a_in)` and `mlp(m_in)` include their pre-norms."""
    a_in = state.prefix if not state.blocks else attn_site(state.candidates())
    if layer_idx % block_size == 0:
        state.blocks.append(state.prefix)  # type: ignore[arg-type]
        state.prefix = None
    state.add(mixer(a_in))  # type: ignore[arg-type]
    m_in = mlp_site(state.candidates())
    state.add(mlp(m_in))
