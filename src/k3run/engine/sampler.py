"""Next-token selection: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from k3run.engine.runner import staged
from k3run.engine.sequence import SamplingParams
from k3run.kernels.sampling import sample_inverse_cdf


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
    """Turns the last-position logits of a batch into one token per sequence, on the logits' device.

    Each sampled row draws one uniform number u from its own CPU generator and takes the first token whose
    cumulative probability exceeds u (inverse CDF, the cumulative sums in float64 on the device:
    kernels/sampling, three launches on CUDA). So a seeded request produces the same tokens whatever else
    shares its batch, unseeded rows share `default_generator`, and only the chosen token ids come back to
    the host: no [B, V] copy, and no per-row host pass over the vocabulary (a CPU multinomial over K3's
    163840 tokens took ~5 ms a row). Greedy rows take the argmax, computed only when the batch has one.
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self.default_generator = default_generator or torch.Generator(device="cpu")

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        return self.sample(logits, params, generators).tolist()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """The tokens [B] int64 on the logits' device, without waiting for the GPU (the per-row parameters go
        up by a non-blocking copy from pinned memory)."""
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [B, V] with B = {len(params)}, got {tuple(logits.shape)}")
        logits = logits.float()
        rows = [b for b, p in enumerate(params) if not p.greedy]
        if len(rows) < len(params):
            out = logits.argmax(dim=-1)
        else:  # every row is sampled: each gets its token below
            out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        if not rows:
            return out
        # per row: index, temperature, top_k, top_p, u; one host-to-device copy
        u = [float(torch.rand((), generator=generators[b] or self.default_generator)) for b in rows]
        spec = torch.tensor(
            [[b, params[b].temperature, params[b].top_k, params[b].top_p, ub] for b, ub in zip(rows, u)],
            dtype=torch.float64,
        )
        spec = staged(spec, logits.device).to(logits.device, non_blocking=True)
        if any(params[b].top_k > 0 or params[b].top_p < 1.0 for b in rows):
            scaled = logits.index_select(0, spec[:, 0].long()) / spec[:, 1:2].float()
            scaled = apply_top_k_top_p(scaled, spec[:, 2].long(), spec[:, 3].float())
            return sample_inverse_cdf(scaled, spec, out, scaled=True)
        return sample_inverse_cdf(logits, spec, out)
