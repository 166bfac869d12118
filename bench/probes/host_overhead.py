"""Question: how much of a small call's time is host work: eager back-to-back calls (common.eager_ms: the GPU
waits whenever the host is slower) against the same call replayed from a CUDA graph (no host work), per call?

    PYTHONPATH=src python bench/probes/host_overhead.py

Cases: fla's fused recurrent KDA through our kda_forward (K3 layer: H = 96, K = V = 128) at B = 1, 16, 64, and
the NVFP4 linear at M = 1 on 7168 x 7168 (the Gluon decode kernel). A ratio well above 1 means the eager time
is the host's, and an engine decode step needs graph capture to see the kernel's speed.

Answer (H200, bench/RESULTS.md run 10): eager / graph 21.3x for the KDA step at B = 1 (191 against 9 us),
2.8x at B = 16, 1.1x at B = 64, 3.5x for the NVFP4 GEMV at M = 1: decode steps are host-bound eagerly, which
led to the CUDA-graph decode (engine/runner.py GraphDecoder).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from bench_kda import inputs  # noqa: E402
from common import eager_ms, graph_ms  # noqa: E402

from k3run.formats import quantize_nvfp4  # noqa: E402
from k3run.kernels.kda import kda_forward  # noqa: E402
from k3run.kernels.nvfp4_gemm import nvfp4_linear, prepare_nvfp4_weight  # noqa: E402


def _graph_or_nan(fn) -> float:
    try:
        return graph_ms([fn], 0.01) * 1e3
    except Exception as e:  # a host sync inside the call makes capture fail: that is the finding
        print(f"capture failed: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        return float("nan")


def main() -> None:
    rows = []
    for b in (1, 16, 64):
        x = inputs(list(range(b + 1)), torch.bfloat16)

        def kda(x=x):
            return kda_forward(
                x["q"], x["k"], x["v"], x["f"], x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                lower_bound=-5.0, scale=128**-0.5, initial_state=x["h0"], cu_seqlens=x["cu"], decode=True,
            )  # fmt: skip

        rows.append((f"KDA recurrent B={b}", eager_ms(kda) * 1e3, _graph_or_nan(kda)))
    q = quantize_nvfp4(torch.randn(7168, 7168, device="cuda"))
    w = prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2)
    xm = torch.randn(1, 7168, device="cuda").bfloat16()
    lin = lambda: nvfp4_linear(xm, w)  # noqa: E731
    rows.append(("NVFP4 7168^2 M=1", eager_ms(lin) * 1e3, _graph_or_nan(lin)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':>22} {'eager us':>9} {'graph us':>9} {'eager/graph':>11}")
    for name, eager, graph in rows:
        print(f"{name:>22} {eager:9.1f} {graph:9.1f} {eager / graph:11.1f}")


if __name__ == "__main__":
    main()
