"""NVFP4 decode: the streaming kernel (gluon_stream.py: persistent programs, TMA ring) against the default
decode launch (choose_config: the cp.async kernel) and cuBLAS bf16, in the same run.

Same timing method as bench_linear.py (CUDA graphs over L2-busting weight copies, back-to-back calls). Prints per
shape and M: cuBLAS bf16, the default launch and every streaming variant (programs per SM : ring slots :
tiles per slot : register cap, 0 = default :
1 = cp.async instead of TMA), each as us, weight TB/s, % of the copy bandwidth measured in the same run and x cuBLAS.

    PYTHONPATH=src python bench/probe_gemv_stream.py [--variants 16:6:1,8:8:1] [--ms 1,16] [--shapes 7168x7168]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_linear import BYTES_PER_NVFP4_WEIGHT, NVFP4_SHAPES, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.formats import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import nvfp4_linear, prepare_nvfp4_weight  # noqa: E402
from k3run.kernels.nvfp4_gemm.gluon_stream import nvfp4_gemv_stream  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="24:2:4:80:1,20:2:4:80:1,16:2:4:96:1,24:3:2:80:1,24:2:4:80:0")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--shapes", default="", help="N x K list (default: the five NVFP4 shapes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s", flush=True)
    variants = [tuple(int(v) for v in (s + ":0:0").split(":")[:5]) for s in args.variants.split(",")]
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else NVFP4_SHAPES
    )
    table = []
    for n, k in shapes:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(copies_for(wbytes))]
        pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
        w_bf16 = [
            dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
            for q in qs[: copies_for(2 * n * k)]
        ]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact = x.float() @ w_bf16[0].float().t()
            t_cub = graph_ms([lambda w=w: F.linear(x, w) for w in w_bf16], 0.05)
            t_def = graph_ms([lambda p=p: nvfp4_linear(x, p) for p in pws], t_cub / 3)
            row = [f"{n}x{k}", m, t_cub * 1e3, t_def * 1e3]
            for ps, st, gr, reg, cp in variants:

                def call(p, ps=ps, st=st, gr=gr, reg=reg, cp=cp):
                    return nvfp4_gemv_stream(
                        x, p.weight, p.scale_bits, p.global_scale, rows=n, per_sm=ps, stages=st,
                        group=gr, maxnreg=reg or None, cp_async=bool(cp),
                    )  # fmt: skip

                try:
                    err = rel_rms_error(exact, call(pws[0]).float())
                    t = graph_ms([lambda p=p: call(p) for p in pws], t_cub / 3)
                except Exception as e:  # a variant that does not build or launch: say so, go on
                    print(f"  {n}x{k} m={m} {ps}:{st}:{gr}:{reg}:{cp}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    row.append(float("nan"))
                    continue
                row.append(t * 1e3)
                print(
                    f"  {n}x{k} m={m} stream {ps}:{st}:{gr}:{reg}:{cp} {t * 1e3:7.2f} us {wbytes / t / 1e9:5.2f} TB/s "
                    f"x cuBLAS {t_cub / t:4.2f} (default {t_def * 1e3:.2f} us) err {err:.1e}",
                    flush=True,
                )
            table.append((row, wbytes))
    print(
        f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, copy {copy_tbs:.2f} TB/s, cmd: {' '.join(sys.argv)}"
    )
    head = f"{'N x K':>11} {'M':>2} {'cuBLAS':>7} {'default':>15}"
    for ps, st, gr, reg, cp in variants:
        head += f" {f'{ps}:{st}:{gr}:{reg}:{cp}':>15}"
    print(head + "   (us, TB/s, x cuBLAS per cell)")
    for row, wbytes in table:
        line = f"{row[0]:>11} {row[1]:>2} {row[2]:7.2f}"
        for us in row[3:]:
            line += f" {us:6.2f} {wbytes / us / 1e6:4.2f} {row[2] / us:3.1f}" if us == us else f" {'-':>15}"
        print(line)


if __name__ == "__main__":
    main()
