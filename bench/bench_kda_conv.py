"""KDA's prefill short conv on one GPU: the varlen Triton kernel (kernels/kda/conv.py) against the torch
reference it replaced (causal_conv1d_ref: per sequence, a concatenated window, W fp32 passes, SiLU), and
against the memory ceiling: the kernel must read x once and write y once (2 * T * C * 2 bytes for bf16),
at the device copy bandwidth measured in the same run.

Shapes: Kimi Linear's q | k | v (3 x 32 heads x 128 = 12288 channels) and K3's (3 x 96 x 128 = 36864), W = 4,
read in place from a wider projection output, with initial states; one sequence and 4 sequences.

    PYTHONPATH=src python bench/bench_kda_conv.py
"""

# ruff: noqa: B023

from __future__ import annotations

import torch
from common import copy_bandwidth, eager_ms, graph_ms  # noqa: E402

from k3run.kernels.kda.conv import causal_conv1d_varlen_triton
from k3run.kernels.kda.ref import causal_conv1d_ref
from k3run.testing import rel_rms_error

W = 4


def main() -> None:
    bw = copy_bandwidth() * 1e12  # bytes / s
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| channels | tokens | sequences | kernel us | reference us | ref / kernel | ceiling us "
          "| ceiling / kernel | rel RMS vs ref |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for C in (12288, 36864):
        for T in (2048, 8192):
            for B in (1, 4):
                wide = torch.randn(T, C + 160, device="cuda", dtype=torch.bfloat16)
                x = wide[:, :C]
                weight = torch.randn(C, W, device="cuda")
                state = torch.randn(B, C, W - 1, device="cuda", dtype=torch.bfloat16)
                cu = torch.linspace(0, T, B + 1, device="cuda").long()
                y, _ = causal_conv1d_varlen_triton(x, weight, cu, state, groups=3)
                ref, _ = causal_conv1d_ref(x, weight, cu, state)
                err = rel_rms_error(ref.float(), y.transpose(0, 1).reshape(T, C).float())
                t_k = graph_ms([lambda: causal_conv1d_varlen_triton(x, weight, cu, state, groups=3)])
                t_r = eager_ms(lambda: causal_conv1d_ref(x, weight, cu, state))  # host loop per sequence
                ceil = 2 * T * C * 2 / bw * 1e6
                print(f"| {C} | {T} | {B} | {t_k * 1e3:.1f} | {t_r * 1e3:.1f} | {t_r / t_k:.1f} | {ceil:.1f} "
                      f"| {ceil / (t_k * 1e3):.0%} | {err:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
