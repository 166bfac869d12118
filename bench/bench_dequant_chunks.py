"""Dequantize + cuBLAS at prefill rows, the weight in row chunks on a second stream (K3RUN_DEQUANT_CHUNKS)
against the one-chunk path, the default path (`nvfp4_linear`) and cuBLAS bf16 on the dense weight, in the
same run, on K3's matrices. us a call in CUDA graphs (common.graph_ms, rotating over weight copies that
overflow the L2), and each path's time over cuBLAS's ("x cuBLAS": issue 19's 4096-row target is >= 0.95).

    PYTHONPATH=src python3 bench/bench_dequant_chunks.py [--ms 1024,4096] [--chunks 2,4,8]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from k3run.formats import dequantize_nvfp4, quantize_nvfp4
from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, prepare_nvfp4_weight
from k3run.knobs import override_knobs
from k3run.testing import rel_rms_error

sys.path.insert(0, str(Path(__file__).parent))
from common import copies_for, graph_ms  # noqa: E402

SHAPES = ((7168, 7168), (12288, 7168), (7168, 12288))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1024,4096")
    ap.add_argument("--chunks", default="2,4,8")
    args = ap.parse_args()
    chunk_list = [int(c) for c in args.chunks.split(",")]
    print(torch.cuda.get_device_name())
    head = " ".join(f"{f'{c} chunks':>10}" for c in chunk_list)
    print(f"{'N x K':>12} {'M':>5} {'cuBLAS':>8} {'default':>8} {'1 chunk':>8} {head}  x cuBLAS")
    for n, k in SHAPES:
        q = quantize_nvfp4(torch.randn(n, k, device="cuda"))
        gs = q.weight_scale_2.reshape(1).float()
        copies = copies_for(n * k * 2)  # the bf16 copies overflow the L2, so the NVFP4 ones do too
        ws = [prepare_nvfp4_weight(q.weight, q.weight_scale, gs, layout="tiled128") for _ in range(copies)]
        wb = [dequantize_nvfp4(q.weight, q.weight_scale, gs).bfloat16() for _ in range(copies)]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            cfg = GemmConfig(dequant_mm=True)
            t_cublas = graph_ms([lambda w=w: x @ w.t() for w in wb]) * 1e3
            t_default = graph_ms([lambda w=w: nvfp4_linear(x, w) for w in ws]) * 1e3
            t_one = graph_ms([lambda w=w: nvfp4_linear(x, w, config=cfg) for w in ws]) * 1e3
            one = nvfp4_linear(x, ws[0], config=cfg)
            times = []
            for c in chunk_list:
                with override_knobs(dequant_chunks=c):
                    err = rel_rms_error(one.float(), nvfp4_linear(x, ws[0], config=cfg).float())
                    if err > 2.0**-8:
                        raise SystemExit(f"{c} chunks differ from one: rel RMS {err:.1e}")
                    times.append(graph_ms([lambda w=w: nvfp4_linear(x, w, config=cfg) for w in ws]) * 1e3)
            best = min(times)
            cols = " ".join(f"{t:>10.1f}" for t in times)
            print(
                f"{f'{n}x{k}':>12} {m:>5} {t_cublas:>8.1f} {t_default:>8.1f} {t_one:>8.1f} {cols}  "
                f"default {t_cublas / t_default:.2f} / 1 chunk {t_cublas / t_one:.2f} / "
                f"chunks {t_cublas / best:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
