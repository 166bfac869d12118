"""The CUDA C++ NVFP4 GEMM for sm_90 (kernels/nvfp4_gemm/w4a16_sm90.cu) beside the Gluon wgmma kernel, the
engine's other paths, cuBLAS bf16 and Marlin INT4, in one process.

Per (N x K, M), us per call, CUDA graphs of back-to-back calls over weight copies that overflow the L2
(common.graph_ms): the CUDA kernel with its default config (`sm90_config`; stream-K where it leaves the fixed
grid, up to K3RUN_SM90_STREAM_K rows, not by default, and the tail split under K3RUN_SM90_TAIL_SPLIT, on
by default), the fixed grid's default config beside it (the same-run baseline, as a ratio) and the best of
a config sweep (split_k 0 = stream-K, -2 = the tail split), and where the default takes it, the x gather
on and off
(printed per cell, not in the table); the Gluon wgmma kernel's
default (the path before it); the engine's M <= 16 decode kernel where M <= 32; dequantize + cuBLAS; cuBLAS
bf16; Marlin INT4 g128 fp16 (the peers tool, its folder given by --peers; built in the background, timed in a
second pass beside the CUDA kernel's best config again). The ceiling per cell: max(weight bytes at the copy
bandwidth measured in the same run, FLOPs at 989 TFLOP/s). Relative RMS of the CUDA kernel's output against
the fp32 reference on every cell.

    PYTHONPATH=src python3 bench/bench_sm90_gemm.py [--shapes 7168x7168,...] [--ms 16,64] [--peers .peers]
        [--no-sweep] [--configs '128,3,1,4;128,2,1,4' (these in place of the sweep, at every M)] [--verbose]
        [--sustain 1.5 (the default config and cuBLAS also back to back for 1.5 s each, with the SM clock and
        power nvidia-smi saw: the power cap a prefill runs at; the short timings above catch the clock high)]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wgmma import PEAK_BF16, _weights, marlin_pass, start_marlin_build  # noqa: E402
from common import (  # noqa: E402
    SmiSampler,
    copies_for,
    copy_bandwidth,
    graph_ms,
    held_text,
    rotating,
    sustain,
)


def _time(fns: list, est_ms: float = 0.05) -> float:
    return graph_ms(fns, est_ms) * 1e3


def _cuda_calls(x, ws, k: int, n: int, cfg, producer=None, gather=None) -> list:
    """One call of the CUDA kernel per weight copy, config `cfg` (None: its default); producer: its form
    (None: K3RUN_SM90_PRODUCER); gather: the x gather (None: K3RUN_SM90_X_GATHER)."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    return [lambda w=w: sm90.nvfp4_sm90_gemm(x, w.weight, w.scale_bits, w.global_scale, k, n, config=cfg,
                                             producer=producer, gather=gather)
            for w in ws]  # fmt: skip


def _sweep(m: int, n: int, k: int) -> list[tuple[int, int, int, int]]:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    chunks = -(-k // 128)
    bts = [b for b in sm90.TOKEN_TILES if min(m, 64) <= b <= max(16, 2 * m)]
    # split_k 0: stream-K; -2: the tail split
    cands = itertools.product(bts, sm90.WARPGROUPS, (0, -2, 1, 2, 3, 4, 7, 8), (3, 4, 5, 6, 8))
    out = [c for c in cands if sm90.config_ok(*c, chunks)]
    return out


def _cell(n, k, m, wd, ws, wb, copy_tbs, sweep, verbose, warm=False, sampler=None, seconds=0.0):
    from k3run.kernels.nvfp4_gemm import GemmConfig, choose_config, nvfp4_linear, sm_count
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_gemm

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ wd.t()

    def cuda(cfg):
        return _cuda_calls(x, ws, k, n, cfg)

    y = cuda(None)[0]()
    if warm:  # a shape's first timing ran slow (run 176: 59.0 against 47.0 us for the same launch): discarded
        _time(cuda(None))
    r = {"shape": f"{n}x{k}", "m": m, "flops": 2 * m * n * k, "cfg": sm90.sm90_config(m, n, k, sm_count(0))}
    r["err"] = float((y.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    r["cuda"] = _time(cuda(None))
    r["fixed_cfg"] = sm90.sm90_config(m, n, k, sm_count(0), stream_k=False)  # the same-run baseline
    r["fixed"] = r["cuda"] if r["fixed_cfg"] == r["cfg"] else _time(cuda(r["fixed_cfg"]))
    # the producer's forms at the default config, back to back
    for form in sm90.PRODUCERS:
        r[form] = _time(_cuda_calls(x, ws, k, n, None, producer=form))
    # the default config with x read in place by the producer and without (where the launch takes it)
    if r["cfg"][2] > 0 and r["cfg"][1] == 1 and r["cfg"][0] <= sm90.GATHER_MAX_BT:
        r["gather_on"] = _time(_cuda_calls(x, ws, k, n, None, gather=True))
        r["gather_off"] = _time(_cuda_calls(x, ws, k, n, None, gather=False))
    best = (r["cuda"], r["cfg"])
    for cfg in sweep:
        try:
            t = _time(cuda(cfg))
        except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
            print(f"  config {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if verbose:
            print(f"  config {cfg}: {t:8.1f} us")
        if t < best[0]:
            best = (t, cfg)
    r["best"], r["best_cfg"] = best
    r["gluon"] = _time(
        [lambda w=w: nvfp4_wgmma_gemm(x, w.weight, w.scale_bits, w.global_scale, k, n) for w in ws]
    )
    if m <= 32:
        dcfg = choose_config(m, n, k, sm_count(0))  # the decode kernel (no wgmma)
        r["decode"] = _time([lambda w=w: nvfp4_linear(x, w, config=dcfg) for w in ws])
    r["dequant"] = _time([lambda w=w: nvfp4_linear(x, w, config=GemmConfig(dequant_mm=True)) for w in ws])
    r["cublas"] = _time([lambda w=w: x @ w.t() for w in wb])
    if sampler is not None:  # back to back for `seconds`: the clock and power a prefill would hold
        r["cuda_sus"], r["cuda_held"] = sustain(rotating(cuda(None)), seconds, sampler)
        r["cublas_sus"], r["cublas_held"] = sustain(
            rotating([lambda w=w: x @ w.t() for w in wb]), seconds, sampler
        )
    wbytes = n * k * (0.5 + 1 / 16)
    r["ceiling"] = max(wbytes / (copy_tbs * 1e12), r["flops"] / PEAK_BF16) * 1e6
    print(
        f"{n:>5}x{k:<5} M={m:<4} cuda {r['cuda']:7.1f} {r['cfg']} fixed grid {r['fixed']:7.1f} "
        f"({r['fixed'] / r['cuda']:4.2f}x) producer thread / warp / tensor {r['thread']:7.1f} / "
        f"{r['warp']:7.1f} / {r['tensor']:7.1f} best {best[0]:7.1f} {best[1]} "
        f"gluon {r['gluon']:7.1f} decode {r.get('decode', float('nan')):7.1f} dequant {r['dequant']:7.1f} "
        f"cuBLAS {r['cublas']:7.1f} ceiling {r['ceiling']:6.1f} err {r['err']:.1e}"
        + (f" x gather on / off {r['gather_on']:7.1f} / {r['gather_off']:7.1f}" if "gather_on" in r else "")
        + (
            f" sustained cuda / cuBLAS {r['cuda_sus']:7.1f} / {r['cublas_sus']:7.1f}"
            if "cuda_sus" in r
            else ""
        ),
        flush=True,
    )
    return r


def _beside_marlin(r: dict, xb, ws, n: int, k: int) -> None:
    """The CUDA kernel's best and default configs, in Marlin's pass."""
    r["cuda2"] = _time(_cuda_calls(xb, ws, k, n, r["best_cfg"]))
    r["cuda2_default"] = _time(_cuda_calls(xb, ws, k, n, None))


def main() -> None:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,12288x7168,7168x12288")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--peers", default="")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--configs", default="", help="'BT,NWG,SPLIT,STAGES;...': time these instead of the sweep, at every M"
    )
    ap.add_argument(
        "--sustain", type=float, default=0.0, help="also S seconds back to back: default and cuBLAS"
    )
    args = ap.parse_args()
    given = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    build = start_marlin_build(args.peers)
    import time

    t0 = time.time()
    ok = sm90.available()
    print(f"sm90 CUDA GEMM available: {ok} ({time.time() - t0:.1f} s incl. build) {sm90._error or ''}")
    if not ok:
        return
    copy_tbs = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s, bf16 peak {PEAK_BF16 / 1e12:.0f} TFLOP/s"
    )
    sampler = SmiSampler() if args.sustain > 0 else None
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for n, k in shapes:
        w, wd, ws = _weights(n, k, copies_for(n * k * (0.5 + 1 / 16)))
        wb = [w.to(torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in ms:
            chunks = -(-k // 128)
            sweep = [] if args.no_sweep or m > 256 else _sweep(m, n, k)
            if given:
                sweep = [c for c in given if sm90.config_ok(*c, chunks)]
            rows.append(
                _cell(n, k, m, wd, ws, wb, copy_tbs, sweep, args.verbose, m == ms[0], sampler, args.sustain)
            )
        del ws, wb
        torch.cuda.empty_cache()
    if build is not None:
        build.wait()
        marlin_pass(args.peers, shapes, rows, _beside_marlin)
    print()
    print(
        "| N x K | M | CUDA default (config) | fixed grid (/ default) | producer thread / warp / tensor | "
        "CUDA best (config) | Gluon wgmma | "
        "decode | dequant+cuBLAS | "
        "cuBLAS bf16 | Marlin (CUDA best / default, same pass) | ceiling | x Marlin | x cuBLAS | x Gluon | "
        "TFLOP/s | rel RMS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mar = f"{r['marlin']:.1f} ({r['cuda2']:.1f} / {r['cuda2_default']:.1f})" if "marlin" in r else "-"
        xm = f"{r['marlin'] / r['cuda2']:.2f}" if "marlin" in r else "-"
        print(
            f"| {r['shape']} | {r['m']} | {r['cuda']:.1f} {r['cfg']} | {r['fixed']:.1f} {r['fixed_cfg']} "
            f"({r['fixed'] / r['cuda']:.2f}x) | {r['thread']:.1f} / {r['warp']:.1f} / {r['tensor']:.1f} | "
            f"{r['best']:.1f} {r['best_cfg']} | "
            f"{r['gluon']:.1f} | {r.get('decode', float('nan')):.1f} | {r['dequant']:.1f} | "
            f"{r['cublas']:.1f} | {mar} | {r['ceiling']:.1f} | {xm} | {r['cublas'] / r['best']:.2f} | "
            f"{r['gluon'] / r['best']:.2f} | "
            f"{r['flops'] / r['best'] / 1e6:.0f} | {r['err']:.1e} |"
        )
    if sampler is not None:
        sampler.close()
        print()
        print(
            "| N x K | M | sustained: CUDA default | cuBLAS bf16 | x cuBLAS | held MHz / W: CUDA | cuBLAS |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            held = [held_text(r[h]) for h in ("cuda_held", "cublas_held")]
            print(
                f"| {r['shape']} | {r['m']} | {r['cuda_sus']:.1f} | {r['cublas_sus']:.1f} | "
                f"{r['cublas_sus'] / r['cuda_sus']:.2f} | {held[0]} | {held[1]} |"
            )


if __name__ == "__main__":
    main()
