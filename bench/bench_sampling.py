"""kernels/sampling (inverse-CDF sampling in three launches) against the torch chain it replaced.

Per batch of sampled rows at K3's / Kimi's 163840-token vocabulary: us per call of the torch reference
(row gather, division, max, exp, float64 chunked scans, searchsorted, scatter: what engine/sampler.py ran)
and of the kernels, both timed inside CUDA graphs (common.graph_ms: GPU time, no host launch cost), the
ceiling (the logits read once at the copy bandwidth measured in the same run), and whether the tokens agree.
Needs CUDA.

    python3 bench/bench_sampling.py [--batches 1,8,32] [--vocab 163840]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from k3run.kernels.sampling import sample_inverse_cdf_ref
from k3run.kernels.sampling.triton import sample_inverse_cdf_triton

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, graph_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=163840)
    args = ap.parse_args()
    tbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {tbs:.2f} TB/s, vocabulary {args.vocab}")
    print(
        f"{'B':>3} {'torch us':>9} {'kernels us':>10} {'speed-up':>8} {'ceiling us':>10} {'of ceiling':>10} "
        "same"
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in [int(v) for v in args.batches.split(",")]:
        logits = torch.randn(b, args.vocab, device="cuda", generator=g) * 3
        u = torch.rand(b, device="cuda", generator=g, dtype=torch.float64)
        idx = torch.arange(b, device="cuda", dtype=torch.float64)
        spec = torch.stack([idx, torch.full_like(idx, 0.8), idx * 0, idx * 0 + 1, u], dim=1)
        out_t = torch.empty(b, dtype=torch.int64, device="cuda")
        out_k = torch.empty(b, dtype=torch.int64, device="cuda")
        ref, ker = (
            partial(sample_inverse_cdf_ref, logits, spec, out_t),
            partial(sample_inverse_cdf_triton, logits, spec, out_k),
        )
        t_t, t_k = graph_ms([ref]) * 1e3, graph_ms([ker]) * 1e3
        same = torch.equal(ref(), ker())
        ceil = logits.numel() * 4 / (tbs * 1e12) * 1e6
        print(f"{b:>3} {t_t:>9.1f} {t_k:>10.1f} {t_t / t_k:>7.2f}x {ceil:>10.2f} {ceil / t_k:>10.1%} {same}")


if __name__ == "__main__":
    main()
