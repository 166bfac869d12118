"""fp32 torch references of the fused norms (the operations layers/norm.py and layers/attn_res.py ran)."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if gate is not None:
        y = y * torch.sigmoid(gate.float())
    return y.to(out_dtype or x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(s), s) for s = x + residual in their dtype (the pre-norm residual stream's add)."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def attn_res_mix_ref(cands: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax_n(rmsnorm(cand_n) . query) weighted sum of the un-normalised candidates, fp32 math."""
    v = torch.stack([c.float() for c in cands])  # [n, T, D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax(k @ query.float(), dim=0)  # [n, T]
    return (p.unsqueeze(-1) * v).sum(0).to(cands[0].dtype)
