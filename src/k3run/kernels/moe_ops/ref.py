"""fp32 torch references of kernels/moe_ops (the oracle on every device, the implementation off CUDA)."""

from __future__ import annotations

import torch


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] (any float dtype) times the fp32 router weight [E, D]^T in fp32 -> logits [T, E] fp32."""
    return x.float() @ weight.float().t()


def sigmoid_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
    extra: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sigmoid top-k routing without group limits: logits fp32 [T, E] -> (weights fp32 [T, A], ids int64
    [T, A]). The experts are picked by sigmoid(logits) + bias, in descending order; the weights are the
    unbiased sigmoid scores of the picks, divided by their sum (+ 1e-20) when renormalize and A > 1, times
    scale. `extra` (an expert id) appends column A: that expert, weight 1, for every token (a shared expert
    run as one more expert: `append_pick`)."""
    scores = torch.sigmoid(logits)
    ids = (scores + bias.float()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return append_pick(weights * scale, ids, extra)


def append_pick(
    weights: torch.Tensor, ids: torch.Tensor, extra: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, A], ids [T, A]) with expert `extra` appended to every token at weight 1 ([T, A + 1]);
    unchanged for None."""
    if extra is None:
        return weights, ids
    t = ids.shape[0]
    return (
        torch.cat([weights, weights.new_ones(t, 1)], 1),
        torch.cat([ids, ids.new_full((t, 1), extra)], 1),
    )


def gated_ref(
    gate: torch.Tensor, up: torch.Tensor, kind: str, beta: float, linear_beta: float | None
) -> torch.Tensor:
    """The gated activation on separately given halves, fp32 math and result (no cast):
    silu: silu(g) * u; situ (K3): beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta)
    (u unchanged when linear_beta is None)."""
    g, u = gate.float(), up.float()
    if kind == "silu":
        return torch.nn.functional.silu(g) * u
    h = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return h * u


def combine_ref(
    y: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's expert outputs y [T * A, D] (pick order) summed with its routing weights [T, A] in fp32
    -> [T, D], rounded to out_dtype; add [T, D] (the shared experts' output) is added after that rounding."""
    t, a = weights.shape
    out = (y.float().view(t, a, -1) * weights.float().unsqueeze(-1)).sum(1).to(out_dtype)
    return out if add is None else out + add
