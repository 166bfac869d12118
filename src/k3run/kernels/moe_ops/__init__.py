"""The small operations around the routed experts as single launches on CUDA, the torch references elsewhere.

- `route_sigmoid_topk(x, weight, bias, top_k, renormalize, scale, extra)`: the router without group limits:
  logits x [T, D] . W [E, D]^T in fp32 (x cast as it loads), sigmoid scores, the biased choice, top-k, the
  unbiased weights renormalised and scaled; `extra` (an expert id) appends it to every token's picks at
  weight 1 (the shared expert run as one more expert of the grouped launches). Two launches: the logits as
  partial sums over column blocks (many small programs, so the fp32 weight streams at a useful rate even
  for one token; from 5 to K3RUN_MOE_ROUTER_DOT (default 64) tokens of bf16 x on the tensor cores, the fp32
  weight as three exact bf16 parts; cuBLAS above that and K3RUN_MOE_ROUTER_PARTIALS), then one program per
  token that sums the partials in order and picks.
- `sigmoid_topk(logits, ...)`: the top-k kernel on given logits.
- `gated(gate_up, kind, beta, linear_beta, out_dtype)`: SiLU / K3's SiTU on [N, 2I] gate | up rows -> [N, I].
- `combine(y, weights, out_dtype, add)`: the top-k weighted sum of each token's expert outputs in fp32, slot
  by slot, rounded to out_dtype, plus the shared experts' output (the MoE layer's last two elementwise ops).

Why kernels: in a decode step each torch version is a chain of 4-11 launches of 2-3 us each on a few rows (the
torch router alone is 11 launches a layer, ~28 us of GPU time, a fifth of a full-depth Kimi Linear step at
batch 1). The references (`ref.py`) are the same fp32 operations; the kernels follow torch's order of
operations (IEEE divisions, libdevice exp / tanh), but sums run in a different order, so the tests state fp32
bounds; the top-k picks the same experts whenever no two choices tie (ties go to the lower expert index).
K3RUN_MOE_OPS=0 keeps the torch versions on CUDA too (for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3run.knobs import knobs

from .ref import append_pick, combine_ref, gated_ref, router_logits_ref, sigmoid_topk_ref


def _cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and knobs().moe_ops


def route_sigmoid_topk(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The router without group limits, x [T, D] -> (weights fp32 [T, A], ids int64 [T, A]; A + 1 columns
    with `extra`): on CUDA, up to K3RUN_MOE_ROUTER_PARTIALS rows (or 5..K3RUN_MOE_ROUTER_DOT rows of bf16 x),
    two launches (partial logits over column blocks, then the top-k summing them), or with
    K3RUN_MOE_ROUTER_ONE_LAUNCH=1 one where the partials are small (`route_one_launch_triton`: its last
    program picks); otherwise torch's fp32 logits, then `sigmoid_topk`."""
    if _cuda(x) and x.dim() == 2 and weight.dtype == bias.dtype == torch.float32 and weight.is_contiguous():
        from . import triton as kt

        t, e = x.shape[0], weight.shape[0]
        dot = x.dtype == torch.bfloat16 and kt.DOT_FROM <= t <= knobs().moe_router_dot
        if top_k <= e <= kt.MAX_EXPERTS and (dot or t <= knobs().moe_router_partials):
            if not dot and knobs().moe_router_one_launch and kt.router_one_launch_fits(t, e, x.shape[1]):
                return kt.route_one_launch_triton(x, weight, bias, top_k, renormalize, scale, extra)
            parts = kt.router_partials(x, weight, dot=dot)
            return kt.sigmoid_topk_triton(parts, bias, top_k, renormalize, scale, extra)
    return sigmoid_topk(router_logits_ref(x, weight), bias, top_k, renormalize, scale, extra)


def sigmoid_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights fp32 [T, A], ids int64 [T, A]; A + 1 columns with `extra`) of fp32 logits [T, E]
    (ref.sigmoid_topk_ref)."""
    if _cuda(logits) and bias.dtype == torch.float32:
        from .triton import MAX_EXPERTS, sigmoid_topk_triton

        if top_k <= logits.shape[1] <= MAX_EXPERTS:
            return sigmoid_topk_triton(logits, bias, top_k, renormalize, scale, extra)
    return sigmoid_topk_ref(logits, bias, top_k, renormalize, scale, extra)


def gated(
    gate_up: torch.Tensor, kind: str, beta: float, linear_beta: float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """act(gate, up) of gate_up [N, 2I] (gate | up) -> [N, I] in out_dtype (ref.gated_ref, rounded once)."""
    i = gate_up.shape[-1] // 2
    if _cuda(gate_up) and gate_up.dim() == 2:
        from .triton import gated_triton

        return gated_triton(gate_up, kind, beta, linear_beta, out_dtype)
    return gated_ref(gate_up[..., :i], gate_up[..., i:], kind, beta, linear_beta).to(out_dtype)


def combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over slots k of weights[t, k] * y[t * A + k] in fp32 -> [T, D] rounded to out_dtype, then + add
    (in out_dtype's promotion with add's, as torch's add): one launch on CUDA."""
    if _cuda(y) and y.dim() == 2 and (add is None or add.dtype == out_dtype):
        from .triton import combine_triton

        return combine_triton(y, weights, out_dtype, add)
    return combine_ref(y, weights, out_dtype, add)


@dataclass(frozen=True)
class PendingCombine:
    """The routed experts' per-pick outputs y [T * A, D] and routing weights [T, A] whose top-k sum (rounded
    to out_dtype, plus add(): the shared experts' output, joined when called) the consumer computes: the next
    RMSNorm runs it inside its own launch (`RMSNorm.add`), anything else calls `materialize()`."""

    y: torch.Tensor
    weights: torch.Tensor
    out_dtype: torch.dtype
    add: Callable[[], torch.Tensor] | None = None

    def materialize(self) -> torch.Tensor:
        return combine(self.y, self.weights, self.out_dtype, None if self.add is None else self.add())


__all__ = [
    "PendingCombine", "append_pick", "combine", "combine_ref", "gated", "gated_ref", "route_sigmoid_topk",
    "router_logits_ref", "sigmoid_topk", "sigmoid_topk_ref",
]  # fmt: skip
