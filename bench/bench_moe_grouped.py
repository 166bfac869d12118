"""NVFP4 routed experts at decode sizes: the grouped launches against the per-expert loop (bench/NOTES.md,
session 11).

K3's latent experts (D = 3584, I = 3072, SiTU, top-16) with 64 local experts of random NVFP4 weights (1.2 GB,
so the picks' weights stream from DRAM), T = 1 / 4 / 8 / 16 / 32 / 64 / 128 tokens routed by random logits.
Per T:
- loop: fused_experts(grouped=False): sort, one counts read-back, two nvfp4_linear per hit expert (eager:
  it cannot be captured in a CUDA graph);
- per pick (T <= 16): two nvfp4_gemv_grouped launches (every pick reads its expert's weights), the activation
  and the weighted sum, captured in a CUDA graph (the decode step's form);
- by expert: expert_groups + two nvfp4_gemv_by_expert launches (each picked expert read once per group of up
  to `tile` of its tokens; what fused_experts runs for 2..BY_EXPERT_MAX_TOKENS tokens), in a CUDA graph,
  above 16 tokens with both the 16- and the 32-token tile;
with the bytes each form must read (per pick: 18.6 MB per pick; by expert: 18.6 MB per group) per
second and as % of the device copy bandwidth measured in the same run (the ceiling).

    PYTHONPATH=src python bench/bench_moe_grouped.py
"""

# ruff: noqa: B023

from __future__ import annotations

import os
import sys

import torch

from k3run.distributed import TPInfo
from k3run.knobs import reset_knobs
from k3run.layers.activation import GatedActivation
from k3run.layers.moe import FusedExperts, fused_experts, route
from k3run.quant.algo import QuantAlgo
from k3run.quant.experts import FP32_SUM, by_expert_tile

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, eager_ms, graph_ms  # noqa: E402

D, INTER, E, TOP_K = 3584, 3072, 64, 16
BYTES_PER_EXPERT = 3 * D * INTER * (0.5 + 1 / 16)


def experts(e: int = E, d: int = D, inter: int = INTER, act: GatedActivation | None = None) -> FusedExperts:
    """e random W4A16 NVFP4 experts of d -> inter (K3's SiTU by default) on the GPU, repacked for the
    kernels."""
    with torch.device("cuda"):
        ex = FusedExperts(
            e, d, inter, act or GatedActivation("situ", 4.0, 25.0), QuantAlgo.W4A16_NVFP4,
            ep=TPInfo(), params_dtype=torch.bfloat16,
        )  # fmt: skip
    with torch.no_grad():
        for name in ("w13", "w2"):
            getattr(ex, f"{name}_weight").random_(0, 256)
            # E4M3 bytes 0x28..0x47: positive, 2^-4 .. ~1.9: what a block scale of a normal weight looks like
            getattr(ex, f"{name}_weight_scale").view(torch.uint8).random_(0x28, 0x48)
            getattr(ex, f"{name}_weight_scale_2").fill_(2e-3)
    ex.process_after_loading()
    assert ex.scheme.kernels and ex.scheme.tiled, "needs the tiled128 decode kernel (sm_89+)"
    return ex


def eager_us(fn) -> float:
    """us per eager call (the per-expert loop reads counts back to the host: no graph can hold it)."""
    return eager_ms(fn) * 1e3


def _grouped(ex: FusedExperts, x, ids, weights, by_expert: bool) -> torch.Tensor:
    os.environ["K3RUN_MOE_BY_EXPERT"] = "1" if by_expert else "0"  # read when the launches are made
    reset_knobs()
    try:
        return ex.scheme.grouped(ex, x, ids, weights, FP32_SUM)
    finally:
        os.environ.pop("K3RUN_MOE_BY_EXPERT")
        reset_knobs()


def main() -> None:
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth()  # TB/s
    ex = experts()
    rows = []
    for t in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(t, D, device="cuda").bfloat16()
        weights, ids = route(torch.randn(t, E, device="cuda"), torch.zeros(E, device="cuda"), TOP_K)
        loop = fused_experts(ex, x, ids, weights, grouped=False)
        t_loop = eager_us(lambda: fused_experts(ex, x, ids, weights, grouped=False))
        picks, distinct = t * TOP_K, int(ids.unique().numel())
        # the default tile, and above 16 tokens both the 16- and the 32-token tile
        for bt in sorted({by_expert_tile(t, TOP_K, E)} | ({16, 32} if t > 16 else set())):
            os.environ["K3RUN_MOE_BY_EXPERT_TILE"] = str(bt)
            reset_knobs()
            try:
                by_exp = _grouped(ex, x, ids, weights, True)
                err = float((by_exp - loop).norm() / loop.norm())
                assert err < 2.0**-7, f"by expert (tile {bt}) vs loop: relative error {err:.2e}"
                t_exp = graph_ms([lambda: _grouped(ex, x, ids, weights, True)], 1e-3) * 1e3
            finally:
                os.environ.pop("K3RUN_MOE_BY_EXPERT_TILE")
                reset_knobs()
            groups = sum(-(-int(c) // bt) for c in torch.bincount(ids.flatten(), minlength=E))
            tbs_exp = groups * BYTES_PER_EXPERT / (t_exp * 1e-6) / 1e12
            exp_pct = 100 * tbs_exp / copy_tbs
            if t <= 16:
                per_pick = _grouped(ex, x, ids, weights, False)
                err_pp = f"{float((by_exp - per_pick).norm() / per_pick.norm()):.1e}"
                t_pick = graph_ms([lambda: _grouped(ex, x, ids, weights, False)], 1e-3) * 1e3
                tbs_pick = picks * BYTES_PER_EXPERT / (t_pick * 1e-6) / 1e12
                pick = f"per pick {t_pick:7.1f} us {tbs_pick:4.2f} TB/s {100 * tbs_pick / copy_tbs:3.0f}%"
                vs_pick = f"{t_pick / t_exp:4.2f}x per pick"
            else:
                err_pp, pick, vs_pick = "-", f"{'per pick -':>30}", f"{'-':>14}"
            default = "*" if bt == by_expert_tile(t, TOP_K, E) else " "
            rows.append(
                f"T={t:<3} picks {picks:4d} experts {distinct:3d} | loop {t_loop:8.1f} us | {pick} "
                f"| tile {bt:2d}{default} "
                f"groups {groups:3d} by expert {t_exp:7.1f} us {tbs_exp:4.2f} TB/s {exp_pct:3.0f}% "
                f"| {vs_pick}, {t_loop / t_exp:5.1f}x loop | err vs loop {err:.1e}, vs per pick {err_pp}"
            )
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name()
    print(f"\n{name}, copy {copy_tbs:.2f} TB/s, K3 experts D={D} I={INTER}, {E} local, top-{TOP_K}")
    print("(tile: the expert-major token tile, * = the default for that T)")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
