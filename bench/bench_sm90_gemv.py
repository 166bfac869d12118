"""The CUDA C++ decode GEMV for sm_90 (gemv_kernel in kernels/nvfp4_gemm/w4a16_sm90.cu) beside the Gluon
decode kernel it would replace (the same-run baseline), Marlin INT4 g128 and the copy ceiling, in one process.

Per (N x K, M), M <= 16, us per call in CUDA graphs of back-to-back calls over weight copies that overflow the
L2 (common.graph_ms): the Gluon kernel with the engine's launch (`choose_config`: its split_k and register
cap), the CUDA GEMV at the same split_k, and the CUDA GEMV's ratio to it; the ceiling = the weight bytes
(codes + scales) at the copy bandwidth measured in the same run, and the CUDA GEMV's share of it; both
kernels' relative RMS against the fp32 reference. Then a dependent chain (each call's input is the last
call's output, PDL on, 16 calls in one graph): what a decode step's chain of GEMVs sees. With --peers,
Marlin INT4 g128 (fp16) on the K3 matrices (>= 32M weights) in a second pass with both kernels again beside
it (the issue's "x Marlin").

    PYTHONPATH=src python3 bench/bench_sm90_gemv.py [--shapes 7168x7168,...] [--ms 1,8,16] [--peers .peers]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wgmma import _weights, marlin_pass, start_marlin_build  # noqa: E402
from common import copies_for, copy_bandwidth, graph_ms  # noqa: E402

# K3's dense shapes, then Kimi Linear 48B's (KDA in_proj, o_proj, an expert's w13 and w2 as dense matrices)
SHAPES = "7168x7168,12288x7168,7168x12288,12448x2304,2304x4096,2048x2304,2304x1024"


def _calls(x, ws, k: int, n: int, cuda: bool) -> list:
    """One call a weight copy: the CUDA GEMV (cuda) or the Gluon kernel, both at the engine's split_k."""
    from k3run.kernels.nvfp4_gemm import choose_config, nvfp4_linear, sm_count
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    cfg = choose_config(x.shape[0], n, k, sm_count(0))
    if not cuda:
        return [lambda w=w: nvfp4_linear(x, w, config=cfg) for w in ws]
    return [
        lambda w=w: sm90.nvfp4_sm90_gemv(x, w.weight, w.scale_bits, w.global_scale, k, n, split_k=cfg.split_k)
        for w in ws
    ]


def _chain_us(x, w, k: int, n: int, cuda: bool, length: int = 16) -> float:
    """us per call of `length` dependent calls (x -> y -> y' ... on a square weight) in one graph (the values
    grow without bound along the chain; only the time is read)."""

    def chain():
        y = x
        for _ in range(length):
            y = _calls(y, [w], k, n, cuda)[0]()
        return y

    return graph_ms([chain]) * 1e3 / length


def _err(y, ref) -> float:
    return float((y.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def main() -> None:
    from k3run.kernels.nvfp4_gemm import choose_config, sm_count
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--peers", default="")
    args = ap.parse_args()
    if not sm90.available():
        raise SystemExit(f"the sm_90 CUDA extension is not available: {sm90._error}")
    marlin = start_marlin_build(args.peers)
    tbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {tbs:.2f} TB/s")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    rows = []
    for n, k in shapes:
        _, wd, ws = _weights(n, k, copies_for(n * k * (0.5 + 1 / 16)))
        ceiling = n * k * (0.5 + 1 / 16) / (tbs * 1e12) * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = x.float() @ wd.t()  # wd: the dequantized weight, global scale included
            r = {"shape": f"{n}x{k}", "m": m, "split": choose_config(m, n, k, sm_count(0)).split_k}
            r["err_gluon"] = _err(_calls(x, ws[:1], k, n, False)[0](), ref)
            r["err_cuda"] = _err(_calls(x, ws[:1], k, n, True)[0](), ref)
            r["gluon"] = graph_ms(_calls(x, ws, k, n, False)) * 1e3
            r["cuda"] = graph_ms(_calls(x, ws, k, n, True)) * 1e3
            r["ceiling"] = ceiling
            if n == k:
                r["chain_gluon"] = _chain_us(x, ws[0], k, n, False)
                r["chain_cuda"] = _chain_us(x, ws[0], k, n, True)
            rows.append(r)
            print(
                f"{n:>5}x{k:<5} M={m:<3} split {r['split']} gluon {r['gluon']:6.1f} cuda {r['cuda']:6.1f} "
                f"({r['gluon'] / r['cuda']:4.2f}x) ceiling {ceiling:5.1f} ({ceiling / r['cuda']:4.0%} of it) "
                f"err {r['err_gluon']:.1e} / {r['err_cuda']:.1e}"
                + (f" chain {r['chain_gluon']:6.1f} / {r['chain_cuda']:6.1f}" if "chain_cuda" in r else ""),
                flush=True,
            )
        del ws
    if marlin is not None:
        marlin.wait()

        def beside(r, xb, ws, n, k):
            r["gluon2"] = graph_ms(_calls(xb, ws, k, n, False)) * 1e3
            r["cuda2"] = graph_ms(_calls(xb, ws, k, n, True)) * 1e3

        # K3's matrices only: Marlin crashes the process (SIGSEGV) on Kimi Linear's (bench/RESULTS.md)
        marlin_pass(args.peers, [(n, k) for n, k in shapes if n * k >= 32 << 20], rows, beside)
    print("\n| N x K | M | split_k | Gluon decode (us) | CUDA GEMV (us) | CUDA / Gluon speed-up | ceiling "
          "(us) | CUDA of ceiling | chain Gluon / CUDA (us a call) | Marlin (Gluon, CUDA same pass) | "
          "x Marlin Gluon / CUDA |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        chain = f"{r['chain_gluon']:.1f} / {r['chain_cuda']:.1f}" if "chain_cuda" in r else "-"
        mar = xm = "-"
        if "marlin" in r:
            mar = f"{r['marlin']:.1f} ({r['gluon2']:.1f}, {r['cuda2']:.1f})"
            xm = f"{r['marlin'] / r['gluon2']:.2f} / {r['marlin'] / r['cuda2']:.2f}"
        print(
            f"| {r['shape']} | {r['m']} | {r['split']} | {r['gluon']:.1f} | {r['cuda']:.1f} | "
            f"{r['gluon'] / r['cuda']:.2f}x | {r['ceiling']:.1f} | {r['ceiling'] / r['cuda']:.0%} | "
            f"{chain} | {mar} | {xm} |"
        )


if __name__ == "__main__":
    main()
