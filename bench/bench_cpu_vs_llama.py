"""k3run's NVFP4 CPU kernels against llama.cpp's 4-bit mul_mat, in one process, alternating call by call.

k3run: the exact AVX-512 / AVX2 extension (`nvfp4_gemv_simd`, fp32 activations) and the int8-activation
VNNI kernel (`nvfp4_vnni_gemm`, K3RUN_CPU_INT8=1's path), both on one NVFP4 weight from the ModelOpt
quantizer. llama.cpp (bench/llama_cpp/gemv_bench.cpp, loaded with ctypes): Q4_0 and Q4_K in the CPU
backend's repack buffer (its q4_0_8x8 / q4_K_8x8 layouts, int8 activations) and its own NVFP4 type, each a
ggml graph of one mul_mat. Per shape and token count: the best of R rounds (each round calls every
implementation once, in turn), the ratio k3run / llama.cpp's best 4-bit (below 1: k3run faster), and the
int8 kernel's time against the memory ceiling (NVFP4 bytes / the read bandwidth measured in the same run).

    PYTHONPATH=src python bench/bench_cpu_vs_llama.py --lib /path/libgemv_bench.so [--threads 2]
        [--shapes 7168x7168,12288x7168,3072x3584,2048x2304] [--ms 1,4,16] [--rounds 15]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from k3run.formats import quantize_nvfp4
from k3run.kernels import cpu_simd

GGML = {"q4_0": 2, "q4_K": 12, "nvfp4": 40}


def read_gbs(threads: int) -> float:
    """GB/s of a 1 GiB fp32 sum (best of 5), the weights' streaming ceiling."""
    a = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="7168x7168,12288x7168,3072x3584,2048x2304")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = ctypes.CDLL(args.lib)
    lib.gb_create.restype = ctypes.c_void_p
    lib.gb_create.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                              ctypes.c_int]  # fmt: skip
    for f in (lib.gb_run, lib.gb_free, lib.gb_repacked):
        f.argtypes = [ctypes.c_void_p]
    if not cpu_simd.vnni_available():
        raise SystemExit("this CPU has no AVX-512 VNNI: the int8 kernel does not run here")
    bw = read_gbs(args.threads)
    print(f"threads {args.threads}, read bandwidth {bw:.1f} GB/s (1 GiB fp32 sum)")
    print("| N x K | M | k3run exact | k3run int8 | llama Q4_0 | llama Q4_K | llama NVFP4 "
          "| int8 / best llama 4-bit | exact / best | int8 vs ceiling |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        q = quantize_nvfp4(torch.randn(n, k))
        gs = q.weight_scale_2.reshape(1).float()
        packed = cpu_simd.nvfp4_vnni_pack(q.weight, q.weight_scale, gs)
        nbytes = q.weight.numel() + q.weight_scale.numel()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k)
            handles = {  # llama.cpp's NVFP4 has no repacked layout
                name: lib.gb_create(t, n, k, m, args.threads, int(name != "nvfp4"))
                for name, t in GGML.items()
            }
            fns = {
                "exact": lambda x=x: cpu_simd.nvfp4_gemv_simd(x, q.weight, q.weight_scale, gs),
                "int8": lambda x=x: cpu_simd.nvfp4_vnni_gemm(x, packed),
                **{name: (lambda h=h: lib.gb_run(h)) for name, h in handles.items()},
            }
            best = dict.fromkeys(fns, float("inf"))
            for fn in fns.values():
                fn()  # warm-up
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
            llama4 = min(best["q4_0"], best["q4_K"])
            ceiling = nbytes / bw / 1e6
            rp = "".join("r" if lib.gb_repacked(handles[t]) else "" for t in ("q4_0", "q4_K"))
            print(f"| {n}x{k} | {m} | {best['exact']:.3f} | {best['int8']:.3f} | {best['q4_0']:.3f} | "
                  f"{best['q4_K']:.3f} | {best['nvfp4']:.3f} | {best['int8'] / llama4:.2f} | "
                  f"{best['exact'] / llama4:.2f} | {ceiling / best['int8']:.0%} ({rp}) |",
                  flush=True)  # fmt: skip
            for h in handles.values():
                lib.gb_free(h)


if __name__ == "__main__":
    main()
