"""Next-token selection: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from k3run.engine.sequence import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit outside each row's top-k and top-p (nucleus) set.

    logits [B, V] fp32; top_k [B] int64 (0 = off); top_p [B] fp32 (1.0 = off). The nucleus is the smallest
    prefix of the sorted distribution whose mass reaches top_p, so the most likely token always survives.
    Ties at the k-th value are all kept (the threshold is a value, not a count).
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # mass strictly before each token: a token is kept while the tokens ahead of it have not reached top_p
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


class Sampler:
    """Turns the last-position logits of a batch into one token per sequence.

    Sequences with a seed draw from their own CPU generator, so a seeded request produces the same tokens
    whatever else shares its batch; unseeded ones share `default_generator`.
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self.default_generator = default_generator or torch.Generator(device="cpu")

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [B, V] with B = {len(params)}, got {tuple(logits.shape)}")
        logits = logits.float()
        out = logits.argmax(dim=-1).tolist()
        rows = [b for b, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        sel = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[b].temperature for b in rows], device=logits.device)
        top_k = torch.tensor([params[b].top_k for b in rows], dtype=torch.int64, device=logits.device)
        top_p = torch.tensor([params[b].top_p for b in rows], dtype=torch.float32, device=logits.device)
        scaled = logits.index_select(0, sel) / temps.unsqueeze(-1)
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1).cpu()  # [B', V]
        for i, b in enumerate(rows):
            gen = generators[b] or self.default_generator
            out[b] = int(torch.multinomial(probs[i], 1, generator=gen).item())
        return out
