"""kernels/moe_ops against the torch chains they replace, at Kimi Linear 48B and K3 widths, decode batches.

Each row: us per call of the torch version (the baseline, the same launches the model ran before) and of the
kernel, both timed inside CUDA graphs (common.graph_ms: GPU time, no host launch cost), and
the bandwidth ceiling: the bytes the operation must read and write at the copy bandwidth measured in the same
run. Also the expert grouping (`expert_groups`) at the same sizes, its passes form (the baseline column)
against its atomic form (K3RUN_MOE_GROUPS), each table checked against the reference, and the old and new
outputs compared.
Needs CUDA.

    python3 bench/bench_moe_ops.py [--batches 1,8,16,32,64]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from k3run.kernels.moe_ops import ref
from k3run.kernels.moe_ops.triton import (
    combine_triton,
    gated_triton,
    route_one_launch_triton,
    router_one_launch_fits,
    router_partials,
    sigmoid_topk_triton,
)
from k3run.kernels.nvfp4_gemm.groups import expert_groups, expert_groups_ref, same_groups
from k3run.knobs import override_knobs

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, graph_ms  # noqa: E402

SHAPES = {  # name: (hidden, experts, top_k, intermediate, activation)
    "kimi-linear": (2304, 256, 8, 1024, ("silu", 1.0, None)),
    "k3": (7168, 896, 16, 3072, ("situ", 4.0, 25.0)),
}


def _us(fn) -> float:
    return graph_ms([fn]) * 1e3


def _torch_router(x, w, bias, k, scale):
    return ref.sigmoid_topk_ref(x.float() @ w.t(), bias, k, True, scale)


def _kernel_router(x, w, bias, k, scale):
    return sigmoid_topk_triton(router_partials(x, w), bias, k, True, scale)


def _cublas_router(x, w, bias, k, scale):  # the model's router above K3RUN_MOE_ROUTER_PARTIALS
    return sigmoid_topk_triton(x.float() @ w.t(), bias, k, True, scale)


def _dot_router(x, w, bias, k, scale):  # K3RUN_MOE_ROUTER_DOT's path
    return sigmoid_topk_triton(router_partials(x, w, dot=True), bias, k, True, scale)


def _torch_gated(gu, kind, beta, lb):
    i = gu.shape[1] // 2
    return ref.gated_ref(gu[:, :i], gu[:, i:], kind, beta, lb).to(gu.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16,32,64")
    args = ap.parse_args()
    tbs = copy_bandwidth()
    print(f"copy bandwidth {tbs:.2f} TB/s")
    head = f"{'op':<34} {'T':>3} {'torch us':>9} {'kernel us':>9} {'speedup':>8}"
    print(f"{head} {'ceiling us':>10} {'of ceiling':>10}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (d, e, k, i, (kind, beta, lb)) in SHAPES.items():
        print(name)
        w = torch.randn(e, d, device="cuda", generator=g) / d**0.5
        bias = torch.randn(e, device="cuda", generator=g) * 0.1
        for t in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
            rows = []
            logits = x.float() @ w.t()
            ok = torch.equal(
                sigmoid_topk_triton(logits, bias, k, True, 2.0)[1],
                ref.sigmoid_topk_ref(logits, bias, k, True, 2.0)[1],
            )
            rows.append(
                ("router (logits + top-k)", partial(_torch_router, x, w, bias, k, 2.0),
                 partial(_kernel_router, x, w, bias, k, 2.0), w.numel() * 4 + x.numel() * 2)
            )  # fmt: skip
            if t >= 8:  # baseline column: each token block's x loaded after the last block's store
                rows.append(
                    ("router partials, x a block ahead", partial(router_partials, x, w, ahead=False),
                     partial(router_partials, x, w), w.numel() * 4 + x.numel() * 2)
                )  # fmt: skip
            # the tensor-core partials against each path they could replace: the broadcast partials (the
            # model's up to 16 tokens) and cuBLAS's fp32 logits + the top-k kernel (above 16)
            rows.append(
                ("router, dot partials (vs broadcast)", partial(_kernel_router, x, w, bias, k, 2.0),
                 partial(_dot_router, x, w, bias, k, 2.0), w.numel() * 4 + x.numel() * 2)
            )  # fmt: skip
            rows.append(
                ("router, dot partials (vs cuBLAS)", partial(_cublas_router, x, w, bias, k, 2.0),
                 partial(_dot_router, x, w, bias, k, 2.0), w.numel() * 4 + x.numel() * 2)
            )  # fmt: skip
            if router_one_launch_fits(t, e, d):  # baseline column: the two launches it replaces
                one = partial(route_one_launch_triton, x, w, bias, k, True, 2.0)
                rows.append(
                    ("router in one launch (vs two)", partial(_kernel_router, x, w, bias, k, 2.0), one,
                     w.numel() * 4 + x.numel() * 2)
                )  # fmt: skip
            gu = torch.randn(t * k, 2 * i, device="cuda", generator=g).bfloat16()
            rows.append(
                (f"gated {kind} (routed, {t * k} rows)", partial(_torch_gated, gu, kind, beta, lb),
                 partial(gated_triton, gu, kind, beta, lb, torch.bfloat16), gu.numel() * 2 * 3 // 2)
            )  # fmt: skip
            y = torch.randn(t * k, d, device="cuda", generator=g).bfloat16()
            wt = torch.rand(t, k, device="cuda", generator=g)
            rows.append(
                ("combine", partial(ref.combine_ref, y, wt), partial(combine_triton, y, wt),
                 y.numel() * 2 + t * d * 4)
            )  # fmt: skip
            for label, base, kern, nbytes in rows:
                tb, tk = _us(base), _us(kern)
                ceil = nbytes / (tbs * 1e12) * 1e6
                row = f"{label:<34} {t:>3} {tb:>9.2f} {tk:>9.2f} {tb / tk:>7.2f}x"
                print(f"{row} {ceil:>10.2f} {ceil / tk:>10.1%}")
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).reshape(-1).int()
            bt = 8 if t <= 8 else 16
            want = expert_groups_ref(ids, e, bt).cpu()
            times, same = {}, {}
            for form in ("passes", "atomic"):
                with override_knobs(moe_groups=form):
                    got = expert_groups(ids, e, bt).cpu()
                    same[form] = torch.equal(got, want) if form == "passes" else same_groups(got, want)
                    times[form] = _us(partial(expert_groups, ids, e, bt))
            tp, ta = times["passes"], times["atomic"]
            label = f"expert_groups atomic ({t * k} picks)"
            print(
                f"{label:<34} {t:>3} {tp:>9.2f} {ta:>9.2f} {tp / ta:>7.2f}x   reference: passes equal "
                f"{same['passes']}, atomic same groups {same['atomic']}; top-k equal torch's: {ok}"
            )


if __name__ == "__main__":
    main()
