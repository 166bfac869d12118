"""NVFP4 decode kernel launch sweep on the default CUDA layout: split_k x shared-memory stages x warps a
program (x token warps x register cap), against the launch `choose_config` picks, each timed in the same
process. Checks choose_config's split_k rules (bench/RESULTS.md runs 18 and 214). Same timing method as
bench_gemv.py.

    PYTHONPATH=src python bench/sweep_gemv_split.py [--shapes 12448x2304,2304x4096] [--ms 24,32]
        [--splits 1,2,3,6] [--stages 2,3] [--warps 1,2] [--token-warps 1,2,4]

Splits that do not divide the shape's 128-wide chunk count are skipped (the kernel needs whole chunks).
Every row prints the rule's time, the best swept launch and its speed-up over the rule, and the weight
bytes' time at the copy bandwidth measured in the same run (the ceiling).
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.formats import quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import (  # noqa: E402
    CHUNK,
    GemmConfig,
    choose_config,
    nvfp4_linear,
    prepare_nvfp4_weight,
    sm_count,
)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="7168x7168,12288x7168,3072x3584", help="N x K list")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--splits", default="4,8,16,32")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--warps", default="1")
    ap.add_argument("--maxnreg", default="0", help="register caps to sweep (0: the kernel's default)")
    ap.add_argument("--token-warps", default="1", help="warps a program splitting the token columns")
    args = ap.parse_args()
    torch.manual_seed(0)
    tbps = copy_bandwidth()
    print(f"copy bandwidth {tbps:.2f} TB/s", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        qs = [
            quantize_nvfp4(torch.randn(n, k, device="cuda"))
            for _ in range(copies_for(n * k * BYTES_PER_NVFP4_WEIGHT))
        ]
        pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
        chunks = -(-k // CHUNK)
        ceiling_us = n * k * BYTES_PER_NVFP4_WEIGHT / (tbps * 1e12) * 1e6
        for m in _ints(args.ms):
            x = torch.randn(m, k, device="cuda").bfloat16()
            rule = choose_config(m, n, k, sm_count(0))

            def us(c: GemmConfig) -> float:
                return graph_ms([lambda p=p: nvfp4_linear(x, p, config=c) for p in pws], 0.01) * 1e3

            t_rule = us(rule)
            res: dict[str, float] = {}
            for w, tw in ((w, tw) for w in _ints(args.warps) for tw in _ints(args.token_warps)):
                if tw > 1 and (m <= 8 or (m <= 16 and tw > 2)):
                    continue  # fewer than 8 token columns a warp
                for sk in _ints(args.splits):
                    if chunks % sk:
                        continue
                    for st in _ints(args.stages):
                        for cap in _ints(args.maxnreg):
                            c = GemmConfig(
                                gemv=True,
                                num_warps=w,
                                split_k=sk,
                                smem_stages=st,
                                maxnreg=cap or None,
                                token_warps=tw,
                            )
                            name = f"w{w}" + (f"x{tw}" if tw > 1 else "") + f"/sk{sk}/st{st}"
                            res[name + (f"/r{cap}" if cap else "")] = us(c)
            best = min(res, key=res.__getitem__)
            tw_name = f"x{rule.token_warps}" if rule.token_warps > 1 else ""
            rule_name = str(rule)
            if rule.gemv:
                rule_name = f"w{rule.num_warps}{tw_name}/sk{rule.split_k}/st{rule.smem_stages}"
            print(
                f"{n}x{k} m={m}: rule {rule_name} {t_rule:.2f} us; best {best} {res[best]:.2f} us "
                f"({t_rule / res[best]:.2f}x the rule); ceiling {ceiling_us:.2f} us "
                f"(rule at {ceiling_us / t_rule:.0%})",
                flush=True,
            )
            print("  " + "  ".join(f"{name} {t:.2f}" for name, t in res.items()), flush=True)


if __name__ == "__main__":
    main()
