"""Greedy, top-k / top-p masks, temperature, and seeded reproducibility of the sampler."""

from __future__ import annotations

import math

import torch

from k3run.engine.sampler import Sampler, apply_top_k_top_p
from k3run.engine.sequence import SamplingParams


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 37)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.randn(3, 50)
    masked = apply_top_k_top_p(logits, torch.tensor([1, 7, 0]), torch.ones(3))
    for row, k in zip(range(3), (1, 7, 50)):
        kept = torch.isfinite(masked[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(masked[row, kept], logits[row, kept])  # survivors are untouched


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(3, 1)
    masked = apply_top_k_top_p(logits, torch.zeros(3, dtype=torch.int64), torch.tensor([0.45, 0.7, 0.9]))
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in masked]
    # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 2), 0.05 (id 0); mass before each: 0, 0.5, 0.8, 0.95
    assert kept == [{1}, {1, 3}, {1, 3, 2}]


def test_sampled_frequencies_follow_the_renormalised_top_k_distribution() -> None:
    # temperature 0.5 squares the probabilities: with top_k 2 over p ~ [0.4, 0.3, ...] the survivors
    # get 0.4^2 / (0.4^2 + 0.3^2) = 0.64 and 0.36
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    params = SamplingParams(temperature=0.5, top_k=2)
    sampler = Sampler(_gen(1))
    out = sampler(p.log().repeat(n, 1), [params] * n, [None] * n)
    counts = torch.bincount(torch.tensor(out), minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    frac = counts[0] / n
    # binomial standard deviation sqrt(0.64*0.36/4000) = 0.0076; 5 sigma
    assert math.isclose(frac, 0.64, abs_tol=0.038), frac


def test_seed_makes_a_request_reproducible_whatever_shares_its_batch() -> None:
    vocab = 1000
    logits = torch.randn(20, vocab)
    params = SamplingParams(temperature=1.0, seed=123)

    def draws(gen: torch.Generator, batch_with_others: bool) -> list[int]:
        out = []
        sampler = Sampler(_gen(99))
        for t in range(20):
            if batch_with_others:
                rows = torch.stack([torch.randn(vocab), logits[t], torch.randn(vocab)])
                ps = [SamplingParams(temperature=1.0), params, SamplingParams(temperature=0.7)]
                out.append(sampler(rows, ps, [None, gen, None])[1])
            else:
                out.append(sampler(logits[t : t + 1], [params], [gen])[0])
        return out

    alone = draws(_gen(123), batch_with_others=False)
    assert draws(_gen(123), batch_with_others=True) == alone
    assert draws(_gen(124), batch_with_others=False) != alone
