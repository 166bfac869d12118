"""The NVFP4 wgmma GEMM (kernels/nvfp4_gemm/wgmma.py) beside today's paths, cuBLAS bf16 and Marlin INT4.

Per (N x K, M), us per call, CUDA graphs of back-to-back calls over weight copies that overflow the L2
(common.graph_ms): wgmma with its default config (x reordered by a torch copy, and with `gather`: copied
in the operand's order by the kernel itself, launched with PDL) and the best of a small config sweep;
k3run's auto choice (quant.schemes.nvfp4_gemm) and the choice without the wgmma GEMM ("before": decode
kernel / tile GEMM / dequantize + cuBLAS); the Triton tile GEMM; cuBLAS bf16; Marlin INT4 g128 fp16 (the
peers tool, built in the background while the rest runs; only when its folder is given). The ceiling per
cell: max(weight bytes at the copy bandwidth measured in the same run, FLOPs at 989 TFLOP/s, the H200's
dense bf16 peak). Relative RMS of the wgmma output against the fp32
reference on every cell.

--moe T,...: routed experts at prefill sizes (bench_tile.MOE_SHAPES: K3's 3584 -> 3072, top-16, 56 local;
Kimi Linear's 2304 -> 1024, top-8, 256): both grouped GEMMs (+ the device-side grouping, + the activation in
GEMM1's epilogue) on the wgmma kernel at several block sizes, on the Triton tile GEMM (its engine config),
the engine's path (layers.moe.fused_experts, whichever it picks), torch._grouped_mm on bf16 copies of the
experts (the two GEMMs only, picks pre-sorted) and, at the largest T, one pass of the per-expert loop.
TFLOP/s counted as 2 * T * top_k * 3 * D * I.

    PYTHONPATH=src python3 bench/bench_wgmma.py [--shapes 7168x7168,...] [--ms 16,64,256] [--peers .peers]
        [--moe 1024,4096] [--no-dense]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copies_for, copy_bandwidth, graph_ms  # noqa: E402

PEAK_BF16 = 989e12
VERBOSE = False
SS = False  # --ss: the sweep adds the shared-memory A operand form
SS_ONLY = False  # --ss-only: the default config and the ss form's configs only
MOE_STAGES = 0  # 0: grouped_config's ring


def _sweep(m: int, n: int, k: int) -> list[tuple[int, int, int, int]]:
    """The default config and (BN, BT, split, stages) around it: BN 64 / 128, split-K 1 / 2 / 4, rings of 3,
    4, 5, 6 and the deepest that fits (shallower rings leave shared memory for more programs per SM)."""
    from k3run.kernels.nvfp4_gemm.wgmma import _SMEM_BUDGET, smem_bytes, wgmma_config

    chunks = -(-k // 128)
    base = wgmma_config(m, n, k)
    out = {base}
    bts = {base[1], min(256, 2 * base[1])} if m > 128 else {base[1]}
    for bn in (64, 128):
        for bt in sorted(bts):
            for split in (1, 2, 4):
                if chunks % split:
                    continue
                fits = [
                    s
                    for s in range(3, min(8, chunks // split + 2) + 1)
                    if smem_bytes(bn, bt, s) <= _SMEM_BUDGET
                ]
                out.update((bn, bt, split, s) for s in fits if s <= 6 or s == max(fits))
                if SS:  # the shared-memory A operand (`nvfp4_wgmma_gemm(ss=True)`), marked by a 5th field
                    fits = [
                        s
                        for s in range(3, min(8, chunks // split + 2) + 1)
                        if smem_bytes(bn, bt, s, True) <= _SMEM_BUDGET
                    ]
                    out.update((bn, bt, split, s, "ss") for s in fits if s <= 5 or s == max(fits))
    if SS_ONLY:
        out = {c for c in out if len(c) == 5}
    return sorted(out, key=str)


def _weights(n: int, k: int, copies: int):
    from k3run.formats import dequantize_nvfp4, quantize_nvfp4
    from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g)
    q = quantize_nvfp4(w)
    wd = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.float32)
    pw = prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="tiled128")
    import dataclasses

    ws = [pw] + [
        dataclasses.replace(pw, weight=pw.weight.clone(), scale_bits=pw.scale_bits.clone())
        for _ in range(copies - 1)
    ]
    return w, wd, ws


def _time(fn_for, copies: int, est_ms: float) -> float:
    """us per call of fn_for(i)() round-robin over the copies i."""
    return graph_ms([fn_for(i) for i in range(copies)], est_ms) * 1e3


def _wg(x, ws, k: int, n: int, cfg, gather: bool = False):
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_gemm

    ss = cfg is not None and len(cfg) == 5
    cfg = cfg[:4] if ss else cfg
    return lambda i: (
        lambda: nvfp4_wgmma_gemm(
            x, ws[i].weight, ws[i].scale_bits, ws[i].global_scale, k, n, config=cfg, ss=ss, gather=gather
        )
    )


def _auto(x, ws):
    from k3run.quant.schemes import nvfp4_gemm

    return lambda i: lambda: nvfp4_gemm(x, ws[i])


def _before(x, ws, m: int, n: int, k: int):
    """The choice without the wgmma GEMM (decode kernel / tile GEMM / dequantize + cuBLAS)."""
    from k3run.kernels.nvfp4_gemm import choose_config, nvfp4_linear, sm_count

    cfg = choose_config(m, n, k, sm_count(0))
    return lambda i: lambda: nvfp4_linear(x, ws[i], config=cfg)


def _tile(x, ws, k: int, n: int):
    from k3run.kernels.nvfp4_gemm.tile import nvfp4_tile_gemm

    return lambda i: lambda: nvfp4_tile_gemm(x, ws[i].weight, ws[i].scale_bits, ws[i].global_scale, k, n)


def _cublas(x, wb):
    return lambda i: lambda: x @ wb[i].t()


def _cell(n: int, k: int, m: int, w, wd, ws, wb, copy_tbs: float, sweep: list) -> dict:
    """One (shape, M): wgmma default and over `sweep`, auto, tile, cuBLAS, the ceiling."""
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_gemm, smem_bytes

    wbytes = n * k * (0.5 + 1 / 16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ wd.t()
    r = {"shape": f"{n}x{k}", "m": m, "flops": 2 * m * n * k}
    y = nvfp4_wgmma_gemm(x, ws[0].weight, ws[0].scale_bits, ws[0].global_scale, k, n)
    r["err"] = float((y.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    r["wgmma"] = _time(_wg(x, ws, k, n, None), len(ws), 0.05)
    # x copied in the operand's order by the kernel, PDL between the back-to-back calls
    r["gather"] = _time(_wg(x, ws, k, n, None, gather=True), len(ws), 0.05)
    best = (r["wgmma"], None)
    for cfg in sweep:
        try:
            t = _time(_wg(x, ws, k, n, cfg), len(ws), 0.05)
        except Exception as e:  # noqa: BLE001 - a config that fails to build is reported, not fatal
            print(f"  config {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if VERBOSE:
            bn, bt = cfg[0], cfg[1]
            l2 = -(-m // bt) * bt * k * 2 * -(-n // bn) + wbytes * -(-m // bt)
            per_sm = 227 * 1024 // smem_bytes(bn, bt, cfg[3], len(cfg) == 5)
            print(
                f"  config {cfg}: {t:8.1f} us, {l2 / t / 1e6:5.2f} TB/s of x re-reads + weights, "
                f"<= {per_sm} programs an SM by shared memory"
            )
        if t < best[0]:
            best = (t, cfg)
    r["wgmma_best"], r["best_cfg"] = best
    r["auto"] = _time(_auto(x, ws), len(ws), 0.05)
    r["before"] = _time(_before(x, ws, m, n, k), len(ws), 0.05)
    if m > 16:
        r["tile"] = _time(_tile(x, ws, k, n), len(ws), 0.05)
    r["cublas"] = _time(_cublas(x, wb), len(wb), 0.05)
    r["ceiling"] = max(wbytes / (copy_tbs * 1e12), r["flops"] / PEAK_BF16) * 1e6
    print(
        f"{n:>5}x{k:<5} M={m:<5} wgmma {r['wgmma']:8.1f} gather {r['gather']:8.1f} "
        f"(best {best[0]:8.1f} {best[1]}) "
        f"auto {r['auto']:8.1f} before {r['before']:8.1f} "
        f"tile {r.get('tile', float('nan')):8.1f} "
        f"cuBLAS {r['cublas']:8.1f} "
        f"ceiling {r['ceiling']:7.1f} | {r['flops'] / best[0] / 1e6:6.1f} TFLOP/s err {r['err']:.1e}",
        flush=True,
    )
    return r


def start_marlin_build(peers: str) -> subprocess.Popen | None:
    """Marlin's build (the peers folder's marlin_build.py) in the background while the rest runs; None
    without a peers folder. Its log goes to $OUT/marlin_build.log."""
    if not peers:
        return None
    log = open(Path(os.environ.get("OUT", "/tmp")) / "marlin_build.log", "w")
    return subprocess.Popen(
        [sys.executable, str(Path(peers) / "marlin_build.py")], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, MAX_JOBS="4"),
    )  # fmt: skip


def marlin_pass(peers: str, shapes, rows: list[dict], beside) -> None:
    """Marlin INT4 g128 (fp16) timed per row of `rows` (M <= 256) as r["marlin"], one pass per shape; then
    `beside(r, xb, ws, n, k)` times k3run's contestants on the same pass's bf16 input and weight copies."""
    # The peers' folder has a `common` module of its own: import it under that name while the peers load,
    # then give the name back to bench/common.py (the peers keep their bound references).
    ours = sys.modules.pop("common", None)
    sys.path.insert(0, peers)
    try:
        import gemm_peers
        import marlin_build
    finally:
        sys.modules.pop("common", None)
        if ours is not None:
            sys.modules["common"] = ours

    mod, info = marlin_build.load()
    print("marlin build:", {k_: v for k_, v in info.items() if k_ != "attempts"})
    if mod is None:
        return
    for n, k in shapes:
        c = gemm_peers.setup_marlin(
            gemm_peers.weight_for(n, k), copies_for(n * k * 0.5), mod, info["stream_arg"]
        )
        _, _, ws = _weights(n, k, copies_for(n * k * (0.5 + 1 / 16)))
        for r in rows:
            if r["shape"] != f"{n}x{k}" or r["m"] > 256:
                continue
            xh = torch.randn(r["m"], k, device="cuda").to(torch.float16)
            xb = xh.to(torch.bfloat16)
            r["marlin"] = _time(lambda i, c=c, xh=xh: lambda: c.run(xh, c.copies[i]), len(c.copies), 0.05)
            beside(r, xb, ws, n, k)
        del c, ws


def _beside_marlin(r: dict, xb, ws, n: int, k: int) -> None:
    """The best wgmma config and the auto path, in Marlin's pass."""
    r["wgmma2"] = _time(_wg(xb, ws, k, n, r["best_cfg"]), len(ws), 0.05)
    r["auto2"] = _time(_auto(xb, ws), len(ws), 0.05)


def _moe(ts: list[int]) -> None:
    from bench_tile import MOE_SHAPES

    print("| experts | T | picks / expert | wgmma grouped best (BT) | wgmma by BT (us) | tile GEMM (engine "
          "before) | engine path | torch._grouped_mm bf16 | per-expert loop | x tile | x _grouped_mm | "
          "TFLOP/s (wgmma / tile / _grouped_mm) | rel RMS vs tile |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (d, i, e, a) in MOE_SHAPES.items():
        _moe_shape(name, d, i, e, a, ts)
        torch.cuda.empty_cache()


def _moe_shape(name: str, d: int, i: int, e: int, a: int, ts: list[int]) -> None:
    import time

    from bench_moe_grouped import experts as random_experts

    from k3run.kernels.nvfp4_gemm.tile import expert_blocks, nvfp4_tile_gemm_grouped
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_grouped
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import MOE_TILE_BM
    from k3run.testing import rel_rms_error

    act = GatedActivation("situ", 4.0, 25.0) if name == "k3" else GatedActivation("silu")
    actv = (act.kind, act.beta, act.linear_beta)
    ex = random_experts(e, d, i, act)
    gs13, gs2 = ex.scheme.kernel_scales
    s13, s2 = ex.w13_weight_scale.view(torch.uint8), ex.w2_weight_scale.view(torch.uint8)
    wb13 = torch.randn(e, 2 * i, d, device="cuda", dtype=torch.bfloat16)
    wb2 = torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16)
    for t in ts:
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, e, device="cuda", generator=g)
        weights, ids = torch.topk(torch.sigmoid(logits), a, dim=-1)
        picks = t * a
        flops = 2 * picks * 3 * d * i
        est = flops / 400e12 * 1e3
        local = ids.reshape(-1).to(torch.int32)

        def gemms(fn, bm, cfg=None):
            def run():
                grp = expert_blocks(local, e, bm)
                h = fn(
                    x,
                    ex.w13_weight,
                    s13,
                    gs13,
                    grp,
                    picks=picks,
                    x_div=a,
                    k=d,
                    config=cfg,
                    out=torch.empty(picks, i, device="cuda", dtype=torch.bfloat16),
                    activation=actv,
                )
                return fn(h, ex.w2_weight, s2, gs2, grp, picks=picks, x_div=1, k=i, config=cfg,
                          out=torch.empty(picks, d, device="cuda", dtype=torch.bfloat16))  # fmt: skip

            return run

        tile_run = gemms(nvfp4_tile_gemm_grouped, MOE_TILE_BM)
        tile_us = graph_ms([tile_run], est * 3) * 1e3
        ref = tile_run()
        by_bt = {}
        errs = {}
        for bt in (32, 64, 128, 256):
            try:
                run = gemms(nvfp4_wgmma_grouped, bt, (128, MOE_STAGES) if MOE_STAGES else None)
                errs[bt] = rel_rms_error(ref.float(), run().float())
                by_bt[bt] = graph_ms([run], est) * 1e3
            except Exception as err:  # noqa: BLE001
                print(f"moe {name} T={t} BT={bt}: {type(err).__name__}: {str(err)[:300]}", flush=True)
        engine_us = graph_ms([lambda: fused_experts(ex, x, ids, weights)], est) * 1e3
        order = torch.argsort(local, stable=True)
        xs = x[order // a]
        offs = torch.cumsum(torch.bincount(local, minlength=e), 0).to(torch.int32)

        def grouped_bf16():
            gu = torch._grouped_mm(xs, wb13.transpose(1, 2), offs=offs)
            return torch._grouped_mm(gu[:, :i].contiguous(), wb2.transpose(1, 2), offs=offs)

        try:
            gm_us = graph_ms([grouped_bf16], est) * 1e3
        except Exception as err:  # noqa: BLE001
            print(f"moe {name} T={t}: _grouped_mm {type(err).__name__}: {str(err)[:200]}")
            gm_us = float("nan")
        loop = "-"
        if t == max(ts):
            fused_experts(ex, x, ids, weights, grouped=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fused_experts(ex, x, ids, weights, grouped=False)
            torch.cuda.synchronize()
            loop = f"{(time.perf_counter() - t0) * 1e6:.0f}"
        if not by_bt:
            continue
        best = min(by_bt, key=by_bt.get)
        bu = by_bt[best]
        print(
            f"| {name} ({d} -> {i}, top-{a}, {e}) | {t} | {picks / e:.0f} | {bu:.1f} ({best}) | "
            + " / ".join(f"{b}: {v:.1f}" for b, v in by_bt.items())
            + f" | {tile_us:.1f} | {engine_us:.1f} | {gm_us:.1f} | {loop} | {tile_us / bu:.2f} | "
            f"{gm_us / bu:.2f} | {flops / bu / 1e6:.0f} / {flops / tile_us / 1e6:.0f} / "
            f"{flops / gm_us / 1e6:.0f} | {errs[best]:.1e} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,12288x7168,7168x12288")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--peers", default="", help="the peers folder (marlin_build.py, gemm_peers.py)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print every swept config's time")
    ap.add_argument("--sweep-all", action="store_true", help="sweep every shape, not only the first")
    ap.add_argument("--ss", action="store_true", help="sweep the shared-memory A operand form too")
    ap.add_argument("--ss-only", action="store_true", help="sweep only the ss form (beside the default)")
    ap.add_argument("--moe", default="", help="token counts for the grouped-experts stage, e.g. 1024,4096")
    ap.add_argument("--no-dense", action="store_true", help="only the --moe stage")
    ap.add_argument("--moe-stages", type=int, default=0, help="ring slots of the grouped kernel (0: default)")
    args = ap.parse_args()
    global VERBOSE, MOE_STAGES, SS, SS_ONLY
    VERBOSE = args.verbose
    SS = args.ss or args.ss_only
    SS_ONLY = args.ss_only
    MOE_STAGES = args.moe_stages
    if args.moe:
        _moe([int(v) for v in args.moe.split(",")])
    if args.no_dense:
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    build = start_marlin_build(args.peers)
    copy_tbs = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s, bf16 peak {PEAK_BF16 / 1e12:.0f} TFLOP/s"
    )
    rows: list[dict] = []
    best_of: dict[int, tuple] = {}
    for n, k in shapes:
        w, wd, ws = _weights(n, k, copies_for(n * k * (0.5 + 1 / 16)))
        wb = [w.to(torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        # the sweep on the first shape (compiles are per K); the rest try its best
        first = args.sweep_all or (n, k) == shapes[0]
        for m in ms:
            sweep = (
                [] if args.no_sweep else _sweep(m, n, k) if first else [best_of[m]] if m in best_of else []
            )
            r = _cell(n, k, m, w, wd, ws, wb, copy_tbs, sweep)
            if first and r["best_cfg"] is not None:
                best_of[m] = r["best_cfg"]
            rows.append(r)
        del ws, wb
        torch.cuda.empty_cache()
    if build is not None:
        build.wait()
        marlin_pass(args.peers, shapes, rows, _beside_marlin)
    print()
    print(
        "| N x K | M | wgmma default | x gathered + PDL | wgmma best (config) | auto us (before) | tile us | "
        "cuBLAS bf16 | "
        "Marlin us (same pass: wgmma best / auto) | ceiling us | wgmma best TFLOP/s | x Marlin | x cuBLAS | "
        "x auto | rel RMS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mar = f"{r['marlin']:.1f} ({r['wgmma2']:.1f} / {r['auto2']:.1f})" if "marlin" in r else "-"
        xm = f"{r['marlin'] / r['wgmma2']:.2f}" if "marlin" in r else "-"
        print(
            f"| {r['shape']} | {r['m']} | {r['wgmma']:.1f} | {r['gather']:.1f} | {r['wgmma_best']:.1f} "
            f"{r['best_cfg']} | "
            f"{r['auto']:.1f} ({r['before']:.1f}) | {r.get('tile', float('nan')):.1f} | {r['cublas']:.1f} | "
            f"{mar} | "
            f"{r['ceiling']:.1f} | {r['flops'] / r['wgmma_best'] / 1e6:.0f} | {xm} | "
            f"{r['cublas'] / r['wgmma_best']:.2f} | {r['auto'] / r['wgmma_best']:.2f} | {r['err']:.1e} |"
        )


if __name__ == "__main__":
    main()
