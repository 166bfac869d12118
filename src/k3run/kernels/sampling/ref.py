"""The torch reference of inverse-CDF sampling: the oracle of the Triton kernels and the path off CUDA."""

from __future__ import annotations

import torch


def chunked_cdf(probs: torch.Tensor, chunk: int = 512, chunked: bool | None = None) -> torch.Tensor:
    """Inclusive cumulative sums float64 of probs [B, V], contiguous, [B, >= V]: columns past V (zero padding)
    repeat the total. A scan over one long row runs on few GPU blocks, so on CUDA the row is scanned in
    chunks of `chunk` (many rows, in parallel) and each chunk's offset added after."""
    b, v = probs.shape
    p = probs.double()
    if chunked is None:
        chunked = p.is_cuda  # CPU threads scan long rows well: one cumsum there
    if v <= chunk or not chunked:
        return p.cumsum(-1)
    n = -(-v // chunk)
    p = torch.nn.functional.pad(p, (0, n * chunk - v)).view(b, n, chunk)
    local = p.cumsum(-1)  # [B, n, chunk]
    offsets = local[:, :, -1].cumsum(-1) - local[:, :, -1]  # exclusive prefix of the chunk totals
    return (local + offsets.unsqueeze(-1)).view(b, n * chunk)


def sample_inverse_cdf_ref(
    logits: torch.Tensor, spec: torch.Tensor, out: torch.Tensor, scaled: bool = False
) -> torch.Tensor:
    """For each row i of spec [B', 5] float64 (row index r, temperature, top_k, top_p, uniform u): the first
    token whose inclusive float64 cumulative weight exceeds u times the row's total, written to out[r]
    (int64). The weights are exp(s - max(s)) in fp32 (no normalisation: u is scaled by the total instead)
    with s = logits[r] / temperature (fp32 division), or with `scaled` s = logits[i] as given (a row already
    divided and top-k / top-p masked, -inf where masked: weight 0). Returns out."""
    sel = spec[:, 0].long()
    s = logits if scaled else logits.index_select(0, sel) / spec[:, 1:2].float()
    weights = (s - s.amax(dim=-1, keepdim=True)).exp()
    cdf = chunked_cdf(weights)  # [B', >= V]
    vocab = logits.shape[-1]
    target = spec[:, 4:5] * cdf[:, vocab - 1 : vocab]  # u times the row's total mass
    tok = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    out[sel] = tok[:, 0]
    return out
