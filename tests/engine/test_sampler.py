"""Greedy, top-k / top-p masks, temperature, and seeded reproducibility of the sampler."""

from __future__ import annotations

import math

import pytest
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


def test_chunked_cdf_equals_one_cumsum() -> None:
    # float64 sums of fp32 inputs: the chunked and the single scan agree to float64 rounding
    from k3run.kernels.sampling import chunked_cdf as _cdf

    for v in (1, 511, 512, 513, 3001):
        probs = torch.rand(3, v).softmax(-1)
        ref = probs.double().cumsum(-1)
        for chunk in (512, 7):
            cdf = _cdf(probs, chunk=chunk, chunked=True)  # the CUDA path's chunked scan
            assert cdf.is_contiguous() and cdf.shape[1] >= v
            torch.testing.assert_close(cdf[:, :v], ref, rtol=0, atol=1e-12)
            assert torch.equal(
                cdf[:, v:], cdf[:, v - 1 : v].expand(-1, cdf.shape[1] - v)
            )  # padding: the total


def test_inverse_cdf_never_picks_a_masked_token() -> None:
    # top_k 3: whatever uniform each row draws, the token is one of the row's 3 largest
    logits = torch.randn(64, 97)
    out = Sampler(_gen(5))(logits, [SamplingParams(temperature=2.0, top_k=3)] * 64, [None] * 64)
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[r].tolist() for r, t in enumerate(out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_draws_what_the_cpu_sampler_draws() -> None:
    # same uniforms (same CPU generators), float64 CDFs of softmaxes that differ by fp32 ulps: a token can
    # only differ when u falls within ~1e-7 of a boundary, so equality is the expectation at K3's vocab
    logits = torch.randn(8, 163840) * 3
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    params += [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.6, top_p=0.9)]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)]

    def draw(device: str) -> list[int]:
        gens = [_gen(100 + i) if p.seed is not None else None for i, p in enumerate(params)]
        return Sampler(_gen(7))(logits.to(device), params, gens)

    assert draw("cuda") == draw("cpu")
