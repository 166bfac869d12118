"""NVFP4 decode on the default CUDA layout: split_k x shared-memory stages of the cp.async kernel, to check
choose_config's split_k rule (bench/RESULTS.md run 18). Same timing method as bench_gemv.py.

    PYTHONPATH=src python bench/sweep_gemv_split.py
"""

# ruff: noqa: B023

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, graph_ms  # noqa: E402

from k3run.formats import quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import GemmConfig, choose_config, nvfp4_linear, prepare_nvfp4_weight  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    for n, k in [(7168, 7168), (12288, 7168), (3072, 3584)]:
        qs = [
            quantize_nvfp4(torch.randn(n, k, device="cuda"))
            for _ in range(copies_for(n * k * BYTES_PER_NVFP4_WEIGHT))
        ]
        pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            res = []
            for sk in (4, 8, 16, 32):
                for st in (2, 3):
                    c = GemmConfig(gemv=True, num_warps=1, split_k=sk, smem_stages=st)
                    t = graph_ms([lambda p=p: nvfp4_linear(x, p, config=c) for p in pws], 0.01)
                    res.append(f"sk{sk}/st{st} {t * 1e3:.2f}")
            rule = choose_config(m, n, k)
            print(
                f"{n}x{k} m={m} (rule: sk{rule.split_k}/st{rule.smem_stages}): " + "  ".join(res), flush=True
            )


if __name__ == "__main__":
    main()
