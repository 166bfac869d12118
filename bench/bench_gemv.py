"""NVFP4 decode (M <= 32): the Gluon decode kernel's launch sweep against cuBLAS bf16 and the Triton kernel.

The kernel runs on the default CUDA layout (tiled128 on sm_89+: tile-contiguous storage and the shift
decoder).

Same timing method as bench_linear.py (CUDA graphs over L2-busting weight copies, back-to-back calls).
Prints per shape and M: the best Gluon configuration, its time, weight TB/s, % of the copy bandwidth measured
in the same run, and the ratios against cuBLAS bf16 and against the Triton kernel (GemmConfig default).

    PYTHONPATH=src python bench/bench_gemv.py --out /tmp/bench [--full]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_linear import NVFP4_SHAPES  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.formats import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, prepare_nvfp4_weight  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402

TRITON_DEFAULT = GemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4)


def candidates(full: bool, quick: bool = False) -> list[GemmConfig]:
    """1-warp programs (16 rows each), smem_stages 2 / 4 / 8 x split_k 2 / 4 / 8; --full adds 2- and 4-warp
    programs; --quick: 2 stages only (choose_config's launch shape)."""
    out = [
        GemmConfig(gemv=True, num_warps=1, split_k=sk, smem_stages=st)
        for st in ((2,) if quick else (2, 4, 8))
        for sk in (2, 4, 8)
    ]
    if full:
        out += [
            GemmConfig(gemv=True, num_warps=w, split_k=sk, smem_stages=2) for w in (2, 4) for sk in (2, 4, 8)
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--full", action="store_true", help="also 2- and 4-warp programs")
    ap.add_argument(
        "--quick", action="store_true", help="choose_config's launch shape only (3 split_k values)"
    )
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--shapes", default="", help="N x K list, e.g. 7168x7168,3072x3584 (default: all five)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s", flush=True)
    rows = []
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else NVFP4_SHAPES
    )
    for n, k in shapes:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        nc = copies_for(wbytes)
        qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(nc)]
        # register and Triton kernels read split128; the cp.async kernel the default CUDA layout (tiled128)
        pws = [
            prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="split128") for q in qs
        ]
        pwt = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
        w_bf16 = [
            dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
            for q in qs[: copies_for(2 * n * k)]
        ]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact = x.float() @ w_bf16[0].float().t()
            t_cublas = graph_ms([lambda w=w: F.linear(x, w) for w in w_bf16], 0.05)
            t_triton = graph_ms([lambda p=p: nvfp4_linear(x, p, config=TRITON_DEFAULT) for p in pws], 0.05)
            deq = GemmConfig(dequant_mm=True)
            t_deq = graph_ms([lambda p=p: nvfp4_linear(x, p, config=deq) for p in pws], 0.05)
            res = []
            for c in candidates(args.full, args.quick):
                src = pwt
                try:
                    err = rel_rms_error(exact, nvfp4_linear(x, src[0], config=c).float())
                    t = graph_ms([lambda p=p, c=c: nvfp4_linear(x, p, config=c) for p in src], t_cublas / 3)
                except Exception as e:
                    msg = f"  {n}x{k} m={m} w{c.num_warps} sk{c.split_k}: {type(e).__name__}: {e}"
                    print(msg[:400])
                    continue
                res.append((t, c, err))
                print(
                    f"  {n}x{k} m={m} w{c.num_warps} sk{c.split_k} st{c.smem_stages}: "
                    f"{t * 1e3:7.2f} us "
                    f"{wbytes / t / 1e9:5.2f} TB/s err {err:.1e}",
                    flush=True,
                )
            if not res:
                continue
            t, c, err = min(res, key=lambda r: r[0])
            row = dict(
                n=n,
                k=k,
                m=m,
                us=t * 1e3,
                cfg=asdict(c),
                tbs=wbytes / t / 1e9,
                pct_copy=100 * wbytes / t / 1e9 / copy_tbs,
                us_cublas=t_cublas * 1e3,
                us_triton=t_triton * 1e3,
                x_cublas=t_cublas / t,
                x_triton=t_triton / t,
                us_dequant=t_deq * 1e3,
                x_dequant=t_deq / t,
                err=err,
                max_err=max(r[2] for r in res),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, copy {copy_tbs:.2f} TB/s, cmd: {' '.join(sys.argv)}"
    )
    lines = [
        header,
        f"{'N x K':>12} {'M':>3} {'best (warps/split/stages)':>25} {'us':>7} {'TB/s':>6} "
        f"{'%copy':>6} {'cuBLAS us':>9} {'x cuBLAS':>8} {'Triton us':>9} "
        f"{'x Triton':>8} {'deq+mm us':>9} {'x deq':>6} "
        f"{'err':>8}",
    ]
    for r in rows:
        c = r["cfg"]
        lines.append(
            f"{r['n']:>5}x{r['k']:<6} {r['m']:>3} "
            f"{c['num_warps']:>19}/{c['split_k']}/{c['smem_stages']:<4} "
            f"{r['us']:7.2f} {r['tbs']:6.2f} {r['pct_copy']:6.1f} "
            f"{r['us_cublas']:9.2f} {r['x_cublas']:8.2f} "
            f"{r['us_triton']:9.2f} {r['x_triton']:8.2f} {r['us_dequant']:9.2f} {r['x_dequant']:6.2f} "
            f"{r['max_err']:8.1e}"
        )
    text = "\n".join(lines)
    with open(os.path.join(args.out, "bench_gemv.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
        json.dump(dict(header=header, rows=rows), f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
