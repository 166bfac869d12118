"""The expert-major NVFP4 decode launches at Kimi Linear's (or K3's) expert shapes, one launch at a time,
against the bytes they must read and against the same kernel on one dense matrix of the same bytes (the
kernel's own ceiling on this GPU), in the same run.

Kimi Linear 48B-A3B's routed experts: D = 2304 -> I = 1024 (w13 [2048, 2304], w2 [2304, 1024]), 256
experts, top-8, random NVFP4 weights (0.9 GB, so the picks' weights stream from DRAM). For each batch T,
tokens routed uniformly at random (what probe_graph_step --uniform-routing does):
- w13 / w2: `nvfp4_gemv_by_expert` as the decode step launches it (the default tile and split_k from
  `expert_split`), then with every split_k dividing the 128-wide chunk count and, above 8 tokens, each of the
  8-, 16- and 32-token tiles, and with --stages each weight-ring depth (--only-default: the step's launch
  alone); with --stream R/S,.. the stream-K form (`expert_stream.py`: R programs an SM, S ring slots) at the
  step's token tile, each beside the step's launch;
- dense: `nvfp4_gemv` at T rows (at most 32) on the hit experts' matrices stacked as one matrix (the same
  bytes, one weight matrix, no group table), at its `choose_config` split;
each as us, TB/s of weight bytes (the hit experts' NVFP4 bytes and block scales) and % of the device copy
bandwidth measured in the same run.

--k3: K3's experts as the K3-shaped slice holds them: D = 3584 -> I = 3072, 64 local experts, top-16.

    PYTHONPATH=src python bench/bench_expert_gemv.py [--batches 1,8,16,32] [--k3] [--stages 2,3,4]
        [--only-default] [--stream 16/2,20/3]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

import torch

from k3run.kernels.nvfp4_gemm import choose_config, sm_count
from k3run.kernels.nvfp4_gemm.expert_stream import stream_programs
from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv, nvfp4_gemv_by_expert
from k3run.kernels.nvfp4_gemm.groups import expert_groups
from k3run.kernels.nvfp4_gemm.layout import CHUNK
from k3run.layers.activation import GatedActivation
from k3run.layers.moe import route
from k3run.quant.experts import by_expert_tile, expert_split

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_grouped import experts  # noqa: E402
from common import copy_bandwidth, graph_ms  # noqa: E402

KIMI_LINEAR = (2304, 1024, 256, 8, "silu")
K3 = (3584, 3072, 64, 16, "situ")


def splits(k: int) -> list[int]:
    chunks = -(-k // CHUNK)
    return [s for s in (1, 2, 3, 4, 6, 8) if chunks % s == 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--k3", action="store_true", help="K3's experts (64 local, top-16), not Kimi Linear's")
    ap.add_argument(
        "--stages", default="2", help="weight-ring slots of the expert-major launches to time, e.g. 2,3,4"
    )
    ap.add_argument("--only-default", action="store_true", help="only the decode step's launch per batch")
    ap.add_argument("--stream", default="", help="stream-K forms, R/S (programs an SM / slots),..")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth()
    D, INTER, E, TOP_K, act = K3 if args.k3 else KIMI_LINEAR
    ex = experts(E, D, INTER, GatedActivation(act, 4.0, 25.0) if act == "situ" else GatedActivation(act))
    sms = sm_count(0)
    gs13, gs2 = ex.scheme.kernel_scales
    mats = {
        "w13": (ex.w13_weight, ex.w13_weight_scale.view(torch.uint8), gs13, 2 * INTER, D),
        "w2": (ex.w2_weight, ex.w2_weight_scale.view(torch.uint8), gs2, D, INTER),
    }
    rows = []
    stage_list = [int(v) for v in args.stages.split(",")]
    for t in [int(b) for b in args.batches.split(",")]:
        _, ids = route(torch.randn(t, E, device="cuda"), torch.zeros(E, device="cuda"), TOP_K)
        local = ids.reshape(-1).to(torch.int32)
        hit = torch.unique(local)
        distinct = int(hit.numel())
        default_bt = by_expert_tile(t, TOP_K, E)
        for name, (w, s, gs, n, k) in mats.items():
            x = torch.randn(t if name == "w13" else t * TOP_K, k, device="cuda").bfloat16()
            slot_div = TOP_K if name == "w13" else 1
            nbytes = distinct * (w[0].numel() + s[0].numel())
            for bt in sorted({default_bt} | ({8, 16, 32} if t > 8 and not args.only_default else set())):
                grp = expert_groups(local, E, bt)
                used = sum(-(-int(c) // bt) for c in torch.bincount(local, minlength=E))
                auto, reg = expert_split(bt, n * grp.shape[0], k, sms)
                for sk, st in [(sk, st) for sk in splits(k) for st in stage_list]:
                    if args.only_default and (sk != auto or st != 2):
                        continue

                    def call():
                        return nvfp4_gemv_by_expert(
                            x, w, s, gs, grp, picks=t * TOP_K, slot_div=slot_div, rows=n, split_k=sk,
                            maxnreg=reg if sk == auto else None, all_in_groups=True, stages=st,
                        )  # fmt: skip

                    us = graph_ms([call]) * 1e3
                    tbs = nbytes / (us * 1e-6) / 1e12
                    mark = "*" if (sk == auto and bt == default_bt and st == 2) else " "
                    rows.append(
                        f"T={t:<3} {name:3} experts {distinct:3d} groups {used:3d}/{grp.shape[0]:3d} "
                        f"tile {bt:2d} split {sk} stages {st}{mark} | {us:7.1f} us {tbs:4.2f} TB/s "
                        f"{100 * tbs / copy_tbs:3.0f}% of copy"
                    )
                    print(rows[-1], flush=True)
                if bt != default_bt:
                    continue
                for form in [f for f in args.stream.split(",") if f]:
                    per_sm, st = (int(v) for v in form.split("/"))
                    programs = stream_programs(x.device, per_sm, bt)

                    def call_stream():
                        return nvfp4_gemv_by_expert(
                            x, w, s, gs, grp, picks=t * TOP_K, slot_div=slot_div, rows=n, programs=programs,
                            stages=st, all_in_groups=True,
                        )  # fmt: skip

                    us = graph_ms([call_stream]) * 1e3
                    tbs = nbytes / (us * 1e-6) / 1e12
                    rows.append(
                        f"T={t:<3} {name:3} stream {programs // sms:2d}/SM stages {st} tile {bt:2d}"
                        f"{'':22} | {us:7.1f} us {tbs:4.2f} TB/s {100 * tbs / copy_tbs:3.0f}% of copy"
                    )
                    print(rows[-1], flush=True)
            # the same bytes as one dense matrix: the hit experts stacked
            wd = w[hit.long()].reshape(distinct * w.shape[1], w.shape[2])
            sd = s[hit.long()].reshape(distinct * s.shape[1], s.shape[2])
            m = min(t, 32)
            xd = x[:m].contiguous()
            cfg = choose_config(m, wd.shape[0], k, sms)
            gs1 = gs[:1, :1].reshape(1).contiguous()
            kw = dict(tiled=True, split_k=cfg.split_k, maxnreg=cfg.maxnreg)
            us = graph_ms([lambda: nvfp4_gemv(xd, wd, sd, gs1, **kw)]) * 1e3
            tbs = nbytes / (us * 1e-6) / 1e12
            rows.append(
                f"T={t:<3} {name:3} dense {wd.shape[0]}x{k} at M={m} split {cfg.split_k}"
                f" | {us:7.1f} us {tbs:4.2f} TB/s {100 * tbs / copy_tbs:3.0f}% of copy"
            )
            print(rows[-1], flush=True)
    model = "K3" if args.k3 else "Kimi Linear"
    print(f"\n{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s, {model} experts D={D} I={INTER}, "
          f"{E} experts, top-{TOP_K} (* = the decode step's launch)")  # fmt: skip
    print("\n".join(rows))


if __name__ == "__main__":
    main()
