"""Row-wise normalisations as single Triton launches on CUDA, the torch references elsewhere.

- `rms_norm(x, weight, eps, gate=None, out_dtype=None)`: RMSNorm with fp32 math, optionally times
  sigmoid(gate) (KDA's o_norm), rounded once to out_dtype (default x.dtype).
- `add_rms_norm(x, residual, weight, eps)`: the residual stream's add (rounded to x.dtype as torch's add)
  and the RMSNorm of the sum in one launch: returns (normed, sum).
- `add_combine_rms_norm(x, y, weights, add, weight, eps)`: the same with the residual being the routed
  experts' top-k sum (moe_ops' combine) of their per-pick outputs y: the MoE's last launch and the next
  norm's in one.
- `attn_res_mix(cands, query, eps)`: K3's block attention-residual mix over n candidate vectors per token.

Why kernels: in a decode step these run on a few rows, where each of the ~8-10 elementwise / reduction
launches of the torch version costs 2-3 us of GPU time whatever the size (a K3 layer runs ~6 norms and 2
mixes: ~0.1 ms per layer at batch 1, ~9 ms per step over 93 layers). The fused versions read each input
once and write once. The torch references (`ref.py`) are the oracle: the same fp32 operations, summed in
a different order, so results agree to fp32 rounding (the tests state the bound).
"""

from __future__ import annotations

import torch

from .ref import add_rms_norm_ref, attn_res_mix_ref, rms_norm_ref


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., D] -> x / sqrt(mean(x^2) + eps) * weight [* sigmoid(gate)] in fp32, returned in out_dtype
    (default x.dtype)."""
    if _use_triton(x):
        from .triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, gate, out_dtype=out_dtype)  # type: ignore[return-value]
    return rms_norm_ref(x, weight, eps, gate, out_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s, weight, eps), s) for s = x + residual rounded to x.dtype: the same bits as the add and
    the norm run one after the other, one launch on CUDA."""
    if _use_triton(x):
        from .triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual=residual)  # type: ignore[return-value]
    return add_rms_norm_ref(x, residual, weight, eps)


def add_combine_rms_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    add: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x, r, weight, eps) for r = moe_ops.combine(y, weights, x.dtype, add): the routed experts'
    per-pick outputs y [T * A, D] summed with their weights [T, A] (fp32, slot order, rounded to x's dtype,
    plus add), added to the residual stream x [T, D] and normalised; one launch on CUDA, the same bits as the
    two launches on the reference path."""
    if _use_triton(x) and x.dtype != torch.float32:
        from .triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual=y, combine=(weights, add))  # type: ignore[return-value]
    from k3run.kernels.moe_ops import combine

    return add_rms_norm(x, combine(y, weights, x.dtype, add), weight, eps)


def attn_res_mix(cands: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """cands: n tensors [T, D]; query [D] fp32 (norm weight * proj weight). Returns [T, D] in cands' dtype."""
    if cands and _use_triton(cands[0]):
        from .triton import attn_res_mix_triton

        return attn_res_mix_triton(cands, query, eps)
    return attn_res_mix_ref(cands, query, eps)


__all__ = [
    "add_rms_norm", "add_rms_norm_ref", "attn_res_mix", "attn_res_mix_ref", "rms_norm", "rms_norm_ref",
]  # fmt: skip
