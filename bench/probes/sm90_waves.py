"""Does a CTA of the CUDA C++ NVFP4 GEMM run slower when more CTAs run beside it? One wave of the fixed grid
at one config, with the weight's row count chosen so the grid holds a given number of CTAs (one per SM at
most), timed per call; a constant time across the CTA counts means a CTA's speed is its own, a time growing
with them means the CTAs share something that binds (the L2's reads of x, DRAM, the tensor pipes' power).

Why (bench/NOTES.md, session 45): the tail split at 12288 x 7168 / 256 rows (192 tiles of (128, 2) on 132
SMs) gained 1.07-1.09x where 1.33x was predicted from "a tile takes the same time in any wave".

A power limit looks the same from the timings alone (the SMs' clock falls as more of them work), so with
`--sustain S` each grid also runs back to back for S seconds while nvidia-smi samples the SM clock and the
power (bench/common.SmiSampler), and cuBLAS bf16 runs at the same N beside it; `--full N` adds the shipped
launch (default config, the tail split where it applies) at N weight rows.

    PYTHONPATH=src python3 bench/probes/sm90_waves.py [--k 7168] [--m 256] [--ctas 33,66,99,132]
        [--sustain 1.5] [--full 12288] [--out FILE]

Prints, per CTA count: N, us per call, the time against the fewest CTAs' time, the weight bytes a second,
cuBLAS bf16's time at the same N, and under --sustain each one's SM clock (MHz) and power (W) held.
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_wgmma import _weights  # noqa: E402
from common import (  # noqa: E402
    BYTES_PER_NVFP4_WEIGHT,
    SmiSampler,
    copies_for,
    graph_ms,
    held_text,
    rotating,
    sustain,
)


def rows_for(ctas: int, m: int, cfg: tuple[int, int, int, int]) -> int:
    """The weight rows N whose fixed grid at config `cfg` (split 1) and M rows holds `ctas` CTAs (a multiple
    of the token tiles)."""
    bt, nwg = cfg[0], cfg[1]
    t_tiles = -(-m // bt)
    if ctas % t_tiles:
        raise ValueError(f"{ctas} CTAs is not a multiple of the {t_tiles} token tiles of {m} rows at BT {bt}")
    return ctas // t_tiles * 64 * nwg


def main() -> None:
    from k3run.kernels.nvfp4_gemm import sm_count
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--config", default="128,2,1,4")
    ap.add_argument("--ctas", default="")
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls per grid")
    ap.add_argument("--full", type=int, default=0, help="also the default launch at this N")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = tuple(int(v) for v in args.config.split(","))
    if not sm90.available():
        raise SystemExit(f"sm90_waves: the CUDA GEMM is not available ({sm90._error})")
    sms = sm_count(0)
    t_tiles = -(-args.m // cfg[0])
    counts = [int(v) for v in args.ctas.split(",")] if args.ctas else [
        c for c in range(t_tiles, sms + 1, t_tiles) if c % (6 * t_tiles) == 0 or c == sms - sms % t_tiles
    ]  # fmt: skip
    sampler = SmiSampler() if args.sustain > 0 else None
    x = torch.randn(args.m, args.k, device="cuda").to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; M = {args.m}, K = {args.k}, config {cfg}")
    print(
        "| CTAs | N | us per call | x the fewest CTAs' time | weight GB/s | cuBLAS bf16 us | x cuBLAS "
        "| held MHz / W (ours) | held MHz / W (cuBLAS) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows, base = [], None
    grids = [(c, rows_for(c, args.m, cfg), cfg) for c in counts]
    if args.full:
        grids.append((0, args.full, None))
    for c, n, conf in grids:
        w32, _, ws = _weights(n, args.k, copies_for(n * args.k * BYTES_PER_NVFP4_WEIGHT))
        fns = [
            lambda w=w: sm90.nvfp4_sm90_gemm(
                x, w.weight, w.scale_bits, w.global_scale, args.k, n, config=conf
            )
            for w in ws
        ]
        wb = [w32.to(torch.bfloat16)]
        wb += [wb[0].clone() for _ in range(copies_for(n * args.k * 2) - 1)]
        del w32
        blas = [lambda b=b: x @ b.t() for b in wb]
        graph_ms(fns, 0.05)  # a shape's first timing can run slow: discarded
        us = graph_ms(fns, 0.05) * 1e3
        blas_us = graph_ms(blas, 0.05) * 1e3
        if conf is not None:
            base = base or us
        gbs = n * args.k * BYTES_PER_NVFP4_WEIGHT / us / 1e3
        row: dict[str, object] = {"ctas": c or "default", "n": n, "us": us, "cublas_us": blas_us}
        if sampler is not None:
            row["sustained_us"], row["held"] = sustain(rotating(fns), args.sustain, sampler)
            row["cublas_sustained_us"], row["cublas_held"] = sustain(rotating(blas), args.sustain, sampler)
        rows.append(row)
        rel = f"{us / base:.2f}" if conf is not None and base else "-"
        print(
            f"| {c or 'default'} | {n} | {us:.1f} | {rel} | {gbs:.0f} | {blas_us:.1f} | {blas_us / us:.2f} "
            f"| {held_text(row.get('held'))} | {held_text(row.get('cublas_held'))} |",  # type: ignore[arg-type]
            flush=True,
        )
    if sampler is not None:
        sampler.close()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
