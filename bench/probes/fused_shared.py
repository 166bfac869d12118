"""Question: what does Kimi Linear's shared expert cost inside the routed experts' grouped launches (appended
as one more expert that every token picks, `KimiMoE.fuse_shared`) against running it apart (its gate_up
GEMV, the activation, its down GEMV), at 1 / 8 / 16 / 32 / 64 tokens?

Kimi Linear 48B-A3B's widths (D = 2304, I = 1024, 256 experts, top-8, SiLU), random W4A16 NVFP4 weights
(0.9 GB of experts: every call streams its picks' weights from DRAM), every token's picks distinct experts
drawn uniformly. Each form is timed as back-to-back calls in one CUDA graph (bench/common.py): routed alone
(8 picks a token), fused (9: the shared expert appended), apart (the shared MLP alone); "fused - routed" is
what the shared expert adds inside the launches, to compare with "apart".

    PYTHONPATH=src python bench/probes/fused_shared.py
"""

# ruff: noqa: B023

from __future__ import annotations

import sys
from pathlib import Path

import torch

from k3run.distributed import TPInfo
from k3run.kernels.moe_ops import append_pick
from k3run.kernels.nvfp4_gemm import nvfp4_linear, prepare_nvfp4_weight
from k3run.layers.activation import GatedActivation
from k3run.layers.moe import FusedExperts, fused_experts
from k3run.quant.algo import QuantAlgo
from k3run.quant.experts import by_expert_tile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copies_for, graph_ms  # noqa: E402

D, INTER, E, TOP_K = 2304, 1024, 256, 8


def _codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device="cuda")


def _scales(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, device="cuda") * 1.5 + 0.25).to(torch.float8_e4m3fn)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, i = D, INTER
    with torch.device("cuda"):
        ex = FusedExperts(E, d, i, GatedActivation("silu"), QuantAlgo.W4A16_NVFP4, ep=TPInfo(),
                          params_dtype=torch.bfloat16)  # fmt: skip
    for name, shape in (("w13", (E, 2 * i, d)), ("w2", (E, d, i))):
        getattr(ex, f"{name}_weight").data.copy_(_codes(gen, *shape[:2], shape[2] // 2))
        getattr(ex, f"{name}_weight_scale").data.copy_(_scales(gen, *shape[:2], shape[2] // 16))
        getattr(ex, f"{name}_weight_scale_2").data.fill_(0.01)
    ex.process_after_loading()
    g13, g2 = torch.full((2 * i,), 0.01, device="cuda"), torch.full((1,), 0.01, device="cuda")
    # apart: the shared expert's two linears over enough copies that each call reads its weights from DRAM
    # (as a layer's own shared expert does in a decode step); fused: one copy, appended to the stacks
    copies = copies_for(3 * d * i * 9 / 16)
    mlps = []
    for _ in range(copies):
        c13, s13 = _codes(gen, 2 * i, d // 2), _scales(gen, 2 * i, d // 16)
        c2, s2 = _codes(gen, d, i // 2), _scales(gen, d, i // 16)
        mlps.append((prepare_nvfp4_weight(c13, s13, g13), prepare_nvfp4_weight(c2, s2, g2)))
    shared = ex.scheme.append_expert(ex, (c13, s13, g13), (c2, s2, g2), "shared")
    print(f"{torch.cuda.get_device_name()}, Kimi Linear experts {E} x ({d} -> {i}), top-{TOP_K}, us per call")
    head = ("T", "tile", "routed", "fused", "apart", "fused-routed", "routed+apart")
    print(" ".join(f"{h:>13}" for h in head))
    for t in (1, 8, 16, 32, 64):
        x = torch.randn(t, d, generator=gen, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:TOP_K] for _ in range(t)])
        w = torch.rand(t, TOP_K, generator=gen, device="cuda")
        w9, ids9 = append_pick(w, ids, shared)
        routed = graph_ms([lambda: fused_experts(ex, x, ids, w, out_dtype=torch.bfloat16)], 0.05) * 1e3
        fused = graph_ms([lambda: fused_experts(ex, x, ids9, w9, out_dtype=torch.bfloat16)], 0.05) * 1e3
        apart_fns = [lambda m=m: nvfp4_linear(ex.gated(nvfp4_linear(x, m[0])), m[1]) for m in mlps]
        apart = graph_ms(apart_fns, 0.02) * 1e3
        tile = by_expert_tile(t, TOP_K + 1, E + 1) if t > 1 else 0
        row = (t, tile, routed, fused, apart, fused - routed, routed + apart)
        print(" ".join(f"{v:>13}" if isinstance(v, int) else f"{v:13.1f}" for v in row))


if __name__ == "__main__":
    main()
