"""NVFP4 W4A16 decode GEMV on the CPU: the fused compiled loop (kernels/nvfp4_gemm/cpu.py) against the
reference it replaces (dequantize the whole weight to fp32, then matmul), on this machine's cores; above
CPU_FUSED_MAX_M rows (prefill), the compiled one-pass dequantization + matmul.

Per shape and M: the fused time, its NVFP4 bytes (packed codes + E4M3 scales) per second and as % of the
memory copy rate measured in the same run (the ceiling for a kernel that only streams its weights), the
reference's time (the baseline) and the speed-up; for scale, the time of a dense fp32 and a bf16 GEMV of the
same shape (weights kept decoded: 7.1x and 3.6x the NVFP4 bytes in memory). Median of 7 calls after a warm-up
(the first call compiles).

    PYTHONPATH=src python bench/bench_cpu_gemv.py [--shapes 7168x7168,3072x3584,4096x1024] [--ms 1,4,64]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import statistics
import time

import torch

import k3run.kernels.nvfp4_gemm.cpu as cpu
from k3run.formats import quantize_nvfp4
from k3run.kernels.nvfp4_gemm.ref import nvfp4_linear_ref


def _ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbs() -> float:
    """Bytes read + written per second by a 512 MiB tensor copy."""
    a = torch.empty(2**29, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    return 2 * a.numel() / _ms(lambda: b.copy_(a)) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,3072x3584,4096x1024")
    ap.add_argument("--ms", default="1,4,64")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy = copy_gbs()
    cpu.CPU_FUSED_MIN_WEIGHTS = 0  # time the fused loop at every size asked for
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"{torch.get_num_threads()} threads, {isa}, copy {copy:.1f} GB/s")
    head = f"{'shape':>11} {'M':>2} {'fused ms':>9} {'GB/s':>6} {'%copy':>6} {'ref ms':>8} {'speed-up':>8}"
    print(f"{head} {'fp32 ms':>8} {'bf16 ms':>8} {'rel err':>8}")
    # every lambda below is timed inside its own loop iteration
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        q = quantize_nvfp4(torch.randn(n, k))
        w, s, gs = q.weight, q.weight_scale, q.weight_scale_2.reshape(1).float()
        dense = torch.randn(n, k)
        dense_bf16 = dense.bfloat16()
        nbytes = w.numel() + s.numel()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k)
            fused = _ms(lambda: cpu.nvfp4_linear_cpu(x, w, s, gs))
            ref = _ms(lambda: nvfp4_linear_ref(x, w, s, gs), reps=3)
            want = nvfp4_linear_ref(x, w, s, gs)
            err = float((cpu.nvfp4_linear_cpu(x, w, s, gs) - want).norm() / want.norm())
            t32 = _ms(lambda: x @ dense.t())
            t16 = _ms(lambda: x.bfloat16() @ dense_bf16.t())
            gbs = nbytes / fused / 1e6
            row = f"{shape:>11} {m:>2} {fused:>9.2f} {gbs:>6.2f} {100 * gbs / copy:>5.1f}% {ref:>8.2f}"
            print(f"{row} {ref / fused:>7.1f}x {t32:>8.2f} {t16:>8.2f} {err:>8.1e}", flush=True)
    if cpu._disabled:
        print(f"NOTE: the fused path was disabled: {cpu._disabled}")


if __name__ == "__main__":
    main()
