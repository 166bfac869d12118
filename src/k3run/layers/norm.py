"""RMSNorm and the sigmoid-gated RMSNorm of the KDA output (fla FusedRMSNormGated semantics).

Both normalise in fp32 and also apply the weight (and gate) in fp32, rounding once to the activation dtype at
the end: the HF reference rounds x_hat before the weight multiply, so bf16 results may differ from it by one
rounding step; in fp32 they agree exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from k3run.kernels.moe_ops import PendingCombine
from k3run.kernels.norm import add_combine_rms_norm, add_rms_norm
from k3run.kernels.norm import rms_norm as kernel_rms_norm
from k3run.loader import TensorSource, as_source


def norm_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor | TensorSource, shard_id: object = None
) -> None:
    """Copy a weight every TP rank holds whole (norms, embeddings, the router, AttnRes vectors), checking
    the shape; the loader's error names the checkpoint tensor and the parameter."""
    if shard_id is not None:
        raise ValueError(f"replicated weight: shard_id must be None, got {shard_id!r}")
    src = as_source(loaded)
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"replicated weight: expected shape {tuple(param.shape)}, got {tuple(src.shape)}")
    param.data.copy_(src.read().to(param.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, returned in x.dtype (one Triton
    launch on CUDA: kernels/norm)."""
    return kernel_rms_norm(x, weight, eps)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = rms_norm(x) * weight * sigmoid(gate) over the last dim, in fp32, returned in out_dtype (default
    x.dtype)."""
    return kernel_rms_norm(x, weight, eps, gate, out_dtype)


class _NormBase(nn.Module):
    """The learned scale [hidden_size] of both norms: initialised to ones, replicated on every TP rank."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, params_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.weight.weight_loader = norm_weight_loader  # type: ignore[attr-defined]


class RMSNorm(_NormBase):
    """RMSNorm over the last dimension with a learned scale; the weight is replicated on every TP rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        return rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor | PendingCombine | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) for s = x + residual (s = x when residual is None): the pre-norm residual stream's
        add fused with this norm (one launch on CUDA, the same bits as the add followed by forward). A
        PendingCombine residual (the MoE's routed sum left to this norm) is summed in the same launch on
        CUDA (`add_combine_rms_norm`)."""
        if residual is None:
            return self(x), x
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        if isinstance(residual, PendingCombine):
            if residual.out_dtype != x.dtype:
                return add_rms_norm(x, residual.materialize(), self.weight, self.eps)
            add = None if residual.add is None else residual.add()
            return add_combine_rms_norm(x, residual.y, residual.weights, add, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GatedRMSNorm(_NormBase):
    """RMSNorm(x) * weight * sigmoid(gate), the KDA `o_norm`: one weight [K] shared by every head."""

    def forward(
        self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size or gate.shape != x.shape:
            raise ValueError(
                f"GatedRMSNorm: expected x and gate of the same shape [..., {self.hidden_size}], "
                f"got x {tuple(x.shape)} and gate {tuple(gate.shape)}"
            )
        return gated_rms_norm(x, gate, self.weight, self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation=sigmoid"
