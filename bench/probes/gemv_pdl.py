"""Question: where do the fixed microseconds of an NVFP4 decode launch go, and do programmatic dependent
launch or fewer, wider programs remove them?

Answer (bench/RESULTS.md "Runs 20-23", runs 21-22; NOTES.md "v6"): time = 4.16 us + bytes / 3.43 TB/s over 8
shapes at M = 1, and an empty kernel takes 0.99 / 2.91 / 4.45 us at 132 / 3584 / 6144 programs; 2- and 4-warp
programs did not help, PDL triggered after the K loop saves 0.8-1.1 us a launch at M = 1 (7168^2 12.04 ->
11.15 us) and became the default on sm_90. (Per-program %globaltimer stamps, a probe removed in session 32,
later showed the dispatch itself overlaps the first loads.)


0. An empty kernel (one store per program) back to back in a graph: the launch + dispatch floor.
1. Fixed cost vs streaming rate: the default launch at N = 7168 over K = 1024 .. 14336 (and N over
   1792 .. 14336 at K = 7168), M = 1; a least-squares line time = a + bytes / rate.
2. Variants of the cp.async kernel on the five K3 shapes, M = 1 and 16, against cuBLAS bf16 in the same run:
   `pdl` (programmatic dependent launch: the next launch may start once every program of this one has
   left its K loop, and waits for this one to finish before reading x), `w2` / `w4` (2- and 4-warp
   programs: 2x / 4x fewer programs to dispatch), split_k halved / doubled or fixed (sk4 / sk6 / sk8),
   stages (st3), register caps (r80), `wave` / `old` (choose_config's split rule since / before session 11).
   Results must match the base launch bit for bit (same split_k) or to fp32 summation order (split_k
   changed). A variant that does not apply to a shape prints n/a.

Same timing method as bench_gemv.py (CUDA graphs over L2-busting weight copies, back-to-back calls).

    PYTHONPATH=src python bench/probes/gemv_pdl.py [--ncu]   (--ncu: one launch per variant for ncu)
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from bench_linear import NVFP4_SHAPES  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.formats import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import choose_config, one_wave_split, prepare_nvfp4_weight  # noqa: E402
from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
VARIANTS = {
    "base": {},  # the default launch (PDL on sm_90+)
    "nopdl": dict(pdl=False),
    "pdl": dict(pdl=True),
    "w2": dict(num_warps=2),
    "w4": dict(num_warps=4),
    "sk/2": dict(split_div=2),
    "sk*2": dict(split_mul=2),
    "st3": dict(stages=3),
    "sk/2st3": dict(split_div=2, stages=3),
    "r80": dict(maxnreg=80),  # the 16-token tile at 80 registers: 24 programs per SM instead of 20
    "r80sk*2": dict(maxnreg=80, split_mul=2),
    "wave": dict(wave=True),  # one_wave_split (choose_config's rule since session 11)
    "old": dict(old=True),  # choose_config's rule before session 11
    "sk4": dict(split=4),
    "sk6": dict(split=6),
    "sk8": dict(split=8),
    "sk6r80": dict(split=6, maxnreg=80),
    "sk8r80": dict(split=8, maxnreg=80),
}


@triton.jit
def _null_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def null_launch_ms(grid: int, warps: int) -> float:
    """A kernel that only stores one int per program: the launch + dispatch cost of `grid` programs."""
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    return graph_ms([lambda: _null_kernel[(grid,)](out, num_warps=warps)] * 8, 0.003)


def launch(x, p, split_div=1, split_mul=1, wave=False, split=None, old=False, **kw):
    m = x.shape[0]
    cfg = choose_config(m, p.n, p.k, SMS)
    split_k = split or max(1, cfg.split_k * split_mul // split_div)
    kw.setdefault("maxnreg", cfg.maxnreg)
    if wave:  # one_wave_split's choice (what choose_config takes since session 11)
        split_k, kw["maxnreg"] = one_wave_split(m, p.n, p.k, SMS)
    if old:  # choose_config's rule before session 11: 8 for M <= 8, ~1800 programs for M <= 16
        split_k, kw["maxnreg"] = (8 if m <= 8 else max(1, min(8, round(1800 * 16 / p.n)))), None
    return nvfp4_gemv(
        x, p.weight, p.scale_bits, p.global_scale, split_k=split_k,
        stages=kw.pop("stages", cfg.smem_stages), tiled=True, rows=p.n, **kw,
    )  # fmt: skip


def weights(n: int, k: int, copies: int):
    qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(copies)]
    pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="tiled128") for q in qs]
    return qs, pws


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b * bytes: (a in us, 1 / b in TB/s)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sum((p[0] - mx) ** 2 for p in points)
    return (my - b * mx) * 1e3, 1 / b / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ms", default="1,16", help="token counts, e.g. 1,16")
    ap.add_argument("--sweep", default="nopdl,pdl", help="variants of the fixed-cost sweep ('' skips it)")
    args = ap.parse_args()
    names = args.variants.split(",")
    torch.manual_seed(0)
    if args.ncu:
        _, (p,) = weights(7168, 7168, 1)
        x = torch.randn(1, 7168, device="cuda").bfloat16()
        for name in names:
            launch(x, p, **VARIANTS[name])
            torch.cuda.synchronize()
            print("profiled", name, flush=True)
        return
    copy_tbs = copy_bandwidth()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s", flush=True)

    # ---- 0. what an empty launch costs back to back in a graph
    for grid, warps in ((132, 1), (3584, 1), (3584, 4), (6144, 1)):
        t = null_launch_ms(grid, warps)
        print(f"null kernel grid {grid:5d} x {warps} warps: {t * 1e3:5.2f} us", flush=True)

    # ---- 1. fixed cost vs streaming rate
    sweep = [(7168, k) for k in (1024, 2048, 4096, 7168, 14336)] + [(n, 7168) for n in (1792, 3584, 14336)]
    pts: dict[str, list[tuple[float, float]]] = {v: [] for v in args.sweep.split(",") if v}
    if not pts:
        sweep = []
    for n, k in sweep:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        _, pws = weights(n, k, copies_for(wbytes))
        x = torch.randn(1, k, device="cuda").bfloat16()
        row = f"sweep {n:>5}x{k:<6} {wbytes / 1e6:6.1f} MB"
        for v in pts:
            t = graph_ms([lambda p=p: launch(x, p, **VARIANTS[v]) for p in pws], 0.02)
            pts[v].append((wbytes, t))
            row += f" | {v} {t * 1e3:6.2f} us {wbytes / t / 1e9:4.2f} TB/s"
        print(row, flush=True)
    for v, p in pts.items():
        a, rate = fit(p)
        print(f"fit {v}: fixed {a:5.2f} us + bytes / {rate:4.2f} TB/s", flush=True)

    # ---- 2. variants on the K3 shapes
    lines = []
    for n, k in NVFP4_SHAPES:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        qs, pws = weights(n, k, copies_for(wbytes))
        wbf = [
            dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
            for q in qs[: copies_for(2 * n * k)]
        ]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda").bfloat16()
            t_cublas = graph_ms([lambda w=w: F.linear(x, w) for w in wbf], 0.05)
            ref = launch(x, pws[0])
            row = f"{n:>5}x{k:<6} M={m:<3} cuBLAS {t_cublas * 1e3:6.2f} us"
            for name in names:
                try:
                    y = launch(x, pws[0], **VARIANTS[name])
                except ValueError as e:  # a variant that does not apply to this shape
                    row += f" | {name} n/a"
                    print(f"{name}: {e}", flush=True)
                    continue
                if "sk" in name or name in ("wave", "old"):
                    err = (y.float() - ref.float()).norm() / ref.float().norm()
                    assert err < 2**-8, f"{name}: {err:.2e} from the base launch"
                else:
                    assert torch.equal(y, ref), f"{name}: differs from the base launch"
                t = graph_ms([lambda p=p: launch(x, p, **VARIANTS[name]) for p in pws], t_cublas / 3)
                row += f" | {name} {t * 1e3:6.2f} us {wbytes / t / 1e9:4.2f} TB/s {t_cublas / t:4.2f}x"
            print(row, flush=True)
            lines.append(row)
    print(f"\n{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s; us per call, weight TB/s, x cuBLAS")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
