"""Feeding sequences to an attention layer in engine-like steps (chunked prefill, decode, idle sequences),
shared by the KDA and MLA layer tests."""

from __future__ import annotations

from typing import Any

import torch

from k3run.forward_context import ForwardContext


def ctx_for(lens: list[int], ctx_lens: list[int], slots: list[int] | None) -> ForwardContext:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return ForwardContext(
        cu_seqlens=cu,
        context_lens=torch.tensor(ctx_lens),
        slots=None if slots is None else torch.tensor(slots),
    )


def feed_in_steps(
    layer: torch.nn.Module, cache: Any, xs: list[torch.Tensor], steps: list[list[int]], slots: list[int]
) -> list[torch.Tensor]:
    """Feed sequences xs[b] in pieces: steps[i][b] new tokens of sequence b at step i (0 = idle), sequence b
    in cache slot slots[b]; returns each sequence's outputs, concatenated over the steps."""
    done = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for step in steps:
        active = [b for b, n in enumerate(step) if n > 0]
        x = torch.cat([xs[b][done[b] : done[b] + step[b]] for b in active])
        ctx = ctx_for([step[b] for b in active], [done[b] for b in active], [slots[b] for b in active])
        y = layer(x, ctx, cache)
        for b, piece in zip(active, y.split([step[b] for b in active]), strict=True):
            outs[b].append(piece)
            done[b] += step[b]
    return [torch.cat(o) for o in outs]
