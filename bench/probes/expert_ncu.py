"""Question: why does the expert-major NVFP4 launch of Kimi Linear's routed experts stream at ~70% of the copy
rate on an H200 at 8 tokens (run 204: w13 48.0 us, w2 23.6 us alone; ~88% / 76% at 32 tokens), when the same
kernel reaches 86-90% of the H100's? Latency (too few bytes in flight an SM), the tail of the last wave, or
instruction issue? This probe launches one of the step's launches a few times so that ncu can profile one
(DRAM throughput, occupancy, stall reasons per SASS line):

    ncu --clock-control none -k regex:gemv_async --launch-skip 3 --launch-count 1 --set full \
        -o rep python3 bench/probes/expert_ncu.py --t 8 --which w13
    ncu -i rep.ncu-rep --page details

--which w13 | w2: `nvfp4_gemv_by_expert` as the decode step launches it (tile and split from the step's
rules; --stages: the weight ring's slots, --k3: K3's expert shapes); dense: the in_proj of a Kimi Linear KDA
layer (12448 x 2304) at T rows through `nvfp4_gemv` at its `choose_config` (at 17..32 rows in
K3RUN_GEMV_T32_FORM's program form). Random weights, uniform random routing (probe_graph_step
--uniform-routing). It only launches; bench/bench_expert_gemv.py times the same
launches. Answers (H100): bench/NOTES.md "Session 54: what the H100 said" (run 220) and session 55 (run 229).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_moe_grouped import experts

    from k3run.formats import quantize_nvfp4
    from k3run.kernels.nvfp4_gemm import choose_config, prepare_nvfp4_weight, sm_count
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv, nvfp4_gemv_by_expert
    from k3run.kernels.nvfp4_gemm.groups import expert_groups
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import route
    from k3run.quant.experts import by_expert_tile, expert_split

    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8, help="tokens in the step")
    ap.add_argument("--which", choices=("w13", "w2", "dense"), default="w13")
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--stages", type=int, default=2, help="w13 / w2: the weight ring's slots (2: the step's)")
    ap.add_argument("--k3", action="store_true", help="w13 / w2 at K3's shapes (3584 -> 3072, 64, top-16)")
    args = ap.parse_args()
    torch.manual_seed(0)
    t, sms = args.t, sm_count(0)
    if args.which == "dense":
        n, k = 12448, 2304
        q = quantize_nvfp4(torch.randn(n, k, device="cuda"))
        tw = prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="tiled128")
        x = torch.randn(t, k, device="cuda").bfloat16()
        cfg = choose_config(t, n, k, sms)

        def call():
            return nvfp4_gemv(
                x, tw.weight, tw.scale_bits, tw.global_scale, tiled=True, split_k=cfg.split_k,
                maxnreg=cfg.maxnreg, num_warps=cfg.num_warps, token_warps=cfg.token_warps,
            )  # fmt: skip

        what = f"dense {n}x{k} at M={t}, {cfg}"
    else:
        d, inter, e, top_k = (3584, 3072, 64, 16) if args.k3 else (2304, 1024, 256, 8)
        ex = experts(e, d, inter, GatedActivation("silu"))
        gs13, gs2 = ex.scheme.kernel_scales
        _, ids = route(torch.randn(t, e, device="cuda"), torch.zeros(e, device="cuda"), top_k)
        local = ids.reshape(-1).to(torch.int32)
        bt = by_expert_tile(t, top_k, e)
        grp = expert_groups(local, e, bt)
        if args.which == "w13":
            w, s, gs, n, k, div = ex.w13_weight, ex.w13_weight_scale, gs13, 2 * inter, d, top_k
        else:
            w, s, gs, n, k, div = ex.w2_weight, ex.w2_weight_scale, gs2, d, inter, 1
        s = s.view(torch.uint8)
        x = torch.randn(t if args.which == "w13" else t * top_k, k, device="cuda").bfloat16()
        split, reg = expert_split(bt, n * grp.shape[0], k, sms)

        def call():
            return nvfp4_gemv_by_expert(
                x, w, s, gs, grp, picks=t * top_k, slot_div=div, rows=n, split_k=split, maxnreg=reg,
                all_in_groups=True, stages=args.stages,
            )  # fmt: skip

        hit = int(torch.unique(local).numel())
        what = (
            f"{args.which} by expert ({'K3' if args.k3 else 'Kimi Linear'}), {hit} experts hit, tile {bt}, "
            f"split {split}, maxnreg {reg}, {args.stages} ring slots"
        )
    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: {what}; {args.launches} launches")


if __name__ == "__main__":
    main()
