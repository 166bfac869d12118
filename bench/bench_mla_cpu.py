"""The CPU absorbed MLA decode attention (cpu_simd.mla_decode, what the MLA layer's eager decode runs for
bf16 caches) against torch's path it replaces (the cached rows widened to fp32, the scores and the weighted
sum as two fp32 matmuls, the softmax between), one decode query over N cached positions, on this machine's
cores; "einsum ms" is the layer's form before the kernel (three einsums over separately widened columns).

Per heads and N: the times (median of 7 after a warm-up), the speed-up over torch's path, and the kernel
against two ceilings measured in the same run: its FMAs (H (J + L) a position) over the rate of a fp32 matmul
of 2048^3 (the machine's fp32 compute rate as torch reaches it), and its cache bytes (N J bf16) over the
memory copy rate.

    PYTHONPATH=src python bench/bench_mla_cpu.py [--heads 32,96] [--positions 1000,8001,32001]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_cpu_gemv import _ms, copy_gbs  # noqa: E402

from k3run.kernels import cpu_simd  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402

L, R = 512, 64  # kv_lora_rank, qk_rope_head_dim (Kimi Linear and K3)


def _torch_path(q: torch.Tensor, lat: torch.Tensor, scale: float) -> torch.Tensor:
    c = lat.float()
    return torch.softmax((q @ c.T) * scale, dim=-1) @ c[:, :L]


def _einsum_path(q: torch.Tensor, lat: torch.Tensor, scale: float) -> torch.Tensor:
    """The layer's eager decode before the kernel (0c89699): the latent and RoPE columns widened apart, the
    two score terms as einsums and summed, the weighted sum as a third."""
    c, k_pe = lat[:, :L].float(), lat[:, L:].float()
    scores = torch.einsum("hl,sl->hs", q[:, :L], c) + torch.einsum("hr,sr->hs", q[:, L:], k_pe)
    return torch.einsum("hs,sl->hl", torch.softmax(scores * scale, dim=-1), c)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,96")
    ap.add_argument("--positions", default="1000,8001,32001")
    args = ap.parse_args()
    if not cpu_simd.available():
        raise SystemExit(f"the SIMD extension is not available: {cpu_simd._error or 'no AVX2 / AVX-512'}")
    a = torch.randn(2048, 2048)
    gflops = 2 * 2048**3 / _ms(lambda: a @ a) / 1e6
    gbs = copy_gbs()
    print(
        f"{torch.get_num_threads()} threads, {cpu_simd.cpu_level()}: fp32 matmul {gflops:.0f} GFLOP/s, "
        f"copy {gbs:.1f} GB/s"
    )
    print(
        f"{'heads':>5} {'N':>6} {'einsum ms':>9} {'torch ms':>9} {'kernel ms':>9} {'speed-up':>8}"
        f" {'% matmul':>8} {'% copy':>7} err"
    )
    g = torch.Generator().manual_seed(0)
    for h in (int(v) for v in args.heads.split(",")):
        for n in (int(v) for v in args.positions.split(",")):
            lat = torch.randn(n, L + R, generator=g).bfloat16()
            q = torch.randn(h, L + R, generator=g) / (L + R) ** 0.25
            scale = 1.0 / (128 + R) ** 0.5
            t_einsum = _ms(lambda: _einsum_path(q, lat, scale))
            t_torch = _ms(lambda: _torch_path(q, lat, scale))
            t_kern = _ms(lambda: cpu_simd.mla_decode(q, lat, L, scale))
            err = rel_rms_error(_torch_path(q, lat, scale), cpu_simd.mla_decode(q, lat, L, scale))
            flops = 2 * h * n * (L + R + L)
            nbytes = n * (L + R) * 2
            print(
                f"{h:>5} {n:>6} {t_einsum:>9.2f} {t_torch:>9.2f} {t_kern:>9.2f} {t_torch / t_kern:>7.2f}x "
                f"{100 * flops / t_kern / 1e6 / gflops:>7.0f}% "
                f"{100 * nbytes / t_kern / 1e6 / gbs:>6.1f}% {err:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
