"""Grouped FP8_PB_WO routed experts (quant/experts.py Fp8BlockExperts.grouped: kernels/fp8_grouped.py) beside
the per-expert loop they replace and torch._grouped_mm on bf16 copies of the same experts (the two GEMMs
only, picks pre-sorted), one H200, bf16 activations, CUDA graphs of back-to-back calls (common.graph_ms;
the loop, which reads counts back, timed eagerly). TFLOP/s counted as 2 * T * top_k * 3 * D * I; the
ceiling is the H200's dense bf16 peak (989 TFLOP/s).

    PYTHONPATH=src python3 bench/bench_fp8_grouped.py [--tokens 64,1024,4096]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_ms  # noqa: E402

PEAK_BF16 = 989e12
SHAPES = {"kimi-linear": (256, 2304, 1024, 8), "k3-ep16": (56, 3584, 3072, 16)}  # E, D, I, top-k


def experts(e: int, d: int, i: int):
    from k3run.distributed import TPInfo
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import FusedExperts
    from k3run.quant.algo import QuantAlgo

    with torch.device("cuda"):
        ex = FusedExperts(
            e, d, i, GatedActivation("silu"), QuantAlgo.FP8_PB_WO, ep=TPInfo(), params_dtype=torch.bfloat16
        )
    g = torch.Generator(device="cuda").manual_seed(0)
    for w, s in ((ex.w13_weight, ex.w13_weight_scale), (ex.w2_weight, ex.w2_weight_scale)):
        w.data.copy_((torch.randn(w.shape, generator=g, device="cuda") * 64).to(torch.float8_e4m3fn))
        s.data.copy_(torch.rand(s.shape, generator=g, device="cuda") * 1e-3 + 1e-4)
    return ex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,1024,4096")
    ap.add_argument("--shapes", default="kimi-linear,k3-ep16")
    args = ap.parse_args()
    from k3run.kernels.picks import sort_picks
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import FP32_SUM

    print(f"{torch.cuda.get_device_name()}, bf16 activations")
    print(
        "| experts | tokens | grouped fp8 ms | TFLOP/s | of peak | per-expert loop ms | _grouped_mm bf16 ms "
        "| "
        "fp8 / loop | fp8 / _grouped_mm | rel RMS vs loop |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        e, d, i, a = SHAPES[name]
        ex = experts(e, d, i)
        from k3run.formats import dequantize_fp8_block

        w13 = torch.stack(
            [
                torch.cat(
                    [
                        dequantize_fp8_block(ex.w13_weight[k, :i], ex.w13_weight_scale[k, 0], torch.bfloat16),
                        dequantize_fp8_block(ex.w13_weight[k, i:], ex.w13_weight_scale[k, 1], torch.bfloat16),
                    ]
                )
                for k in range(e)
            ]
        ).transpose(1, 2)  # [E, D, 2I]
        w2 = torch.stack(
            [dequantize_fp8_block(ex.w2_weight[k], ex.w2_weight_scale[k], torch.bfloat16) for k in range(e)]
        ).transpose(1, 2)
        for t in [int(v) for v in args.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
            ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:a] for _ in range(t)])
            wts = torch.rand(t, a, device="cuda", generator=g)
            flops = 2 * t * a * 3 * d * i
            grouped = graph_ms([lambda: ex.scheme.grouped(ex, x, ids, wts, FP32_SUM)], 1.0)
            _, order, counts = sort_picks(ids.reshape(-1), e)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            xs = x[order // a]

            def gmm():
                h = ex.activation(torch._grouped_mm(xs, w13, offs=offs))
                return torch._grouped_mm(h, w2, offs=offs)

            mm = graph_ms([gmm], 1.0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loop = fused_experts(ex, x, ids, wts, grouped=False)
            torch.cuda.synchronize()
            loop_ms = (time.perf_counter() - t0) * 1e3
            got = ex.scheme.grouped(ex, x, ids, wts, FP32_SUM)
            err = ((got - loop).pow(2).mean() / loop.pow(2).mean()).sqrt().item()
            tf = flops / grouped / 1e9
            print(
                f"| {name} | {t} | {grouped:.3f} | {tf:.0f} | {tf * 1e12 / PEAK_BF16:.0%} | {loop_ms:.2f} | "
                f"{mm:.3f} | {loop_ms / grouped:.1f}x faster | {grouped / mm:.2f}x the time | {err:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
