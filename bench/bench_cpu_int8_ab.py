"""A/B of the int8-activation NVFP4 CPU kernel's variants in one process, alternating call by call.

Variants: two 16-row blocks per pass (`cpu_simd.INT8_PAIRS = True`, the default at 2-4 tokens) against
one block per pass, on the same activations and weights (cycled through `--copies` copies, so that each
call streams its weight from DRAM rather than the last-level cache). Per shape and token count: the best of
R rounds (the order within a round alternating) of each, their ratio (below 1: pairs faster), and the
paired kernel's time against the memory ceiling (NVFP4 bytes / the read bandwidth of a 1 GiB sum measured
in the same run; the kernel's prefetched stream beats that sum, so above 100% is possible). At one token
both variants run the same code: that row is the harness's own spread. The outputs are checked bit-equal.

    PYTHONPATH=src python bench/bench_cpu_int8_ab.py [--threads 2] [--shapes 7168x7168,...] [--ms 1,2,4,8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from k3run.formats import quantize_nvfp4
from k3run.kernels import cpu_simd

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_vs_llama import read_gbs  # noqa: E402


def _call(x: torch.Tensor, packed, pairs: bool) -> torch.Tensor:
    cpu_simd.INT8_PAIRS = pairs
    return cpu_simd.nvfp4_vnni_gemm(x, packed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="7168x7168,12288x7168,3072x3584,2048x2304")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--copies", type=int, default=8, help="weights cycled through, so calls stream from DRAM")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_simd.vnni_available():
        raise SystemExit("this CPU has no AVX-512 VNNI: the int8 kernel does not run here")
    bw = read_gbs(args.threads)
    print(f"threads {args.threads}, read bandwidth {bw:.1f} GB/s (1 GiB fp32 sum)")
    print("| N x K | M | one block / pass ms | two blocks / pass ms | pairs / single | pairs vs ceiling |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        q = quantize_nvfp4(torch.randn(n, k))
        gs = q.weight_scale_2.reshape(1).float()
        packs = [
            cpu_simd.nvfp4_vnni_pack(q.weight.clone(), q.weight_scale.clone(), gs) for _ in range(args.copies)
        ]
        nbytes = q.weight.numel() + q.weight_scale.numel()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k)
            assert torch.equal(_call(x, packs[0], True), _call(x, packs[0], False)), (
                "the variants' bits differ"
            )
            best = {True: float("inf"), False: float("inf")}
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)  # no variant always second
                for i, pairs in enumerate(order):
                    packed = packs[(2 * r + i) % len(packs)]
                    t0 = time.perf_counter()
                    _call(x, packed, pairs)
                    best[pairs] = min(best[pairs], (time.perf_counter() - t0) * 1e3)
            ceiling = nbytes / bw / 1e6
            row = f"| {n}x{k} | {m} | {best[False]:.3f} | {best[True]:.3f} | {best[True] / best[False]:.2f} |"
            print(f"{row} {ceiling / best[True]:.0%} |", flush=True)
    cpu_simd.INT8_PAIRS = True


if __name__ == "__main__":
    main()
