"""NVFP4 routed experts at decode sizes: the grouped launches against the per-expert loop (bench/NOTES.md,
session 11).

K3's latent experts (D = 3584, I = 3072, SiTU, top-16) with 64 local experts of random NVFP4 weights (1.2 GB,
so the picks' weights stream from DRAM), T = 1 / 4 / 8 tokens routed by random logits. Per T:
- loop: fused_experts(grouped=False): sort, one counts read-back, two nvfp4_linear per hit expert (eager:
  it cannot be captured in a CUDA graph);
- grouped: two nvfp4_gemv_grouped launches over all picks, the activation and the weighted sum, eager and
  captured in a CUDA graph (the decode step's form);
and the weight bytes the grouped launches read per call (every pick reads its expert: 18.6 MB) per second.

    PYTHONPATH=src python bench/bench_moe_grouped.py
"""

# ruff: noqa: B023

from __future__ import annotations

import os
import statistics
import sys

import torch

from k3run.distributed import TPInfo
from k3run.layers.activation import GatedActivation
from k3run.layers.moe import FusedExperts, fused_experts, route
from k3run.quant.algo import QuantAlgo

sys.path.insert(0, os.path.dirname(__file__))
from bench_linear import graph_ms  # noqa: E402

D, INTER, E, TOP_K = 3584, 3072, 64, 16
BYTES_PER_EXPERT = 3 * D * INTER * (0.5 + 1 / 16)


def experts() -> FusedExperts:
    with torch.device("cuda"):
        ex = FusedExperts(
            E, D, INTER, GatedActivation("situ", 4.0, 25.0), QuantAlgo.W4A16_NVFP4,
            ep=TPInfo(), params_dtype=torch.bfloat16,
        )  # fmt: skip
    with torch.no_grad():
        for name in ("w13", "w2"):
            getattr(ex, f"{name}_weight").random_(0, 256)
            # E4M3 bytes 0x28..0x47: positive, 2^-4 .. ~1.9: what a block scale of a normal weight looks like
            getattr(ex, f"{name}_weight_scale").view(torch.uint8).random_(0x28, 0x48)
            getattr(ex, f"{name}_weight_scale_2").fill_(2e-3)
    ex.process_after_loading()
    assert ex.nvfp4_kernels and ex._tiled, "needs the tiled128 decode kernel (sm_89+)"
    return ex


def eager_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    ex = experts()
    rows = []
    for t in (1, 4, 8):
        x = torch.randn(t, D, device="cuda").bfloat16()
        weights, ids = route(torch.randn(t, E, device="cuda"), torch.zeros(E, device="cuda"), TOP_K)
        loop = fused_experts(ex, x, ids, weights, grouped=False)
        got = fused_experts(ex, x, ids, weights)
        err = float((got - loop).norm() / loop.norm())
        assert err < 2.0**-7, f"grouped vs loop: relative error {err:.2e}"
        t_loop = eager_us(lambda: fused_experts(ex, x, ids, weights, grouped=False))
        t_eager = eager_us(lambda: fused_experts(ex, x, ids, weights))
        t_graph = graph_ms([lambda: fused_experts(ex, x, ids, weights)], t_eager * 1e-3) * 1e3
        picks = t * TOP_K
        tbs = picks * BYTES_PER_EXPERT / (t_graph * 1e-6) / 1e12
        rows.append(
            f"T={t:<2} picks {picks:4d} | loop {t_loop:8.1f} us | grouped eager {t_eager:7.1f} us "
            f"({t_loop / t_eager:4.1f}x) | grouped graph {t_graph:7.1f} us ({t_loop / t_graph:4.1f}x), "
            f"{tbs:4.2f} TB/s of pick weights | err {err:.1e}"
        )
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, K3 experts D={D} I={INTER}, {E} local, top-{TOP_K}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
