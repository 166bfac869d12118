"""Held-out evaluation of a checkpoint: perplexity over token windows, and against a reference checkpoint
(e.g. the bf16 original of a quantized one) the KL divergence KL(ref || model) per token and the top-1
agreement of the two models' next-token predictions. `k3run eval` prints `report`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """The first `max_tokens` ids cut into windows of `window` tokens (a last window under 2 dropped)."""
    ids = ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 2]


@dataclass
class EvalResult:
    """Sums over every predicted token (each window's tokens after its first)."""

    tokens: int
    windows: int
    nll: float  # the model's negative log-likelihood
    ref_nll: float | None = None  # the reference's; None without a reference
    kl_sum: float = 0.0  # sum of KL(ref || model) over the predicted positions
    agree: int = 0  # positions where both models' argmax agree

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def ref_perplexity(self) -> float | None:
        return None if self.ref_nll is None else math.exp(self.ref_nll / self.tokens)


def evaluate(
    model: torch.nn.Module,
    wins: list[list[int]],
    device: str,
    ref: torch.nn.Module | None = None,
    progress: bool = True,
) -> EvalResult:
    """Each window's next-token log-probabilities from `model` (one forward without a cache), and from
    `ref` when given, in fp32."""
    import torch
    from tqdm import tqdm

    nll, ref_nll, kl_sum, agree, count = 0.0, 0.0, 0.0, 0, 0
    with torch.inference_mode():
        for w in tqdm(wins, desc="eval", unit="window", file=sys.stderr, disable=not progress):
            ids = torch.tensor(w, dtype=torch.int64, device=device)
            target = ids[1:]
            logp = model.logits(ids)[:-1].float().log_softmax(-1)  # [T-1, vocab]
            nll -= logp.gather(-1, target[:, None]).sum().item()
            count += target.numel()
            if ref is not None:
                ref_logp = ref.logits(ids)[:-1].float().log_softmax(-1)
                ref_nll -= ref_logp.gather(-1, target[:, None]).sum().item()
                kl_sum += (ref_logp.exp() * (ref_logp - logp)).sum().item()
                agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
    return EvalResult(count, len(wins), nll, ref_nll if ref is not None else None, kl_sum, agree)


def report(result: EvalResult, name: str, ref_name: str | None, window: int) -> list[str]:
    """The lines `k3run eval` prints: the token count, then a table of perplexity (and the comparison)."""
    r = result
    lines = [f"held-out: {r.tokens} predicted tokens in {r.windows} windows of <= {window}"]
    rows = [("checkpoint", "perplexity", "vs reference", "KL(ref||model)", "top-1 agreement")]
    ref_ppl = r.ref_perplexity
    if ref_ppl is not None:
        rows.append((f"{ref_name} (reference)", f"{ref_ppl:.4f}", "", "", ""))
        rows.append(
            (
                name,
                f"{r.perplexity:.4f}",
                f"{100 * (r.perplexity / ref_ppl - 1):+.2f}%",
                f"{r.kl_sum / r.tokens:.5f}",
                f"{100 * r.agree / r.tokens:.2f}%",
            )
        )
    else:
        rows.append((name, f"{r.perplexity:.4f}", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]
    return lines
