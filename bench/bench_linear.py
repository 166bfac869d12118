"""Linear-layer kernels on one GPU: NVFP4 W4A16, FP8_PB_WO, against cuBLAS bf16 and naive baselines.

Timing: each variant is captured R times into a CUDA graph, rotating over enough copies of its weights that
they cannot stay in the 50 MB L2 (as in a real decode step over many layers); time per call = graph replay
time / calls, median of 5 replays. Back-to-back launches with no host work in between, so Python launch
overhead is excluded (an engine replays decode steps as graphs); launch gaps inside the graph are included.

Per shape and M it prints time, weight TB/s (small M) or TFLOP/s, % of the device-to-device copy bandwidth
measured in the same run, and ratios against cuBLAS bf16 and naive dequantize-then-matmul.

    PYTHONPATH=src python bench/bench_linear.py --out /tmp/bench   [--quick] [--sweep]
"""

# every lambda below is timed immediately inside its loop iteration, so late binding is harmless
# ruff: noqa: B023

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict

import torch
import torch.nn.functional as F
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, eager_ms, graph_ms  # noqa: E402

from k3run.formats import dequantize_fp8_block, dequantize_nvfp4, quantize_fp8_block, quantize_nvfp4
from k3run.kernels.fp8_act_quant import quantize_act_1x128
from k3run.kernels.fp8_act_quant.triton import fp8_act_quant
from k3run.kernels.fp8_gemm import fp8_pb_wo_linear, fp8_pb_wo_linear_ref
from k3run.kernels.nvfp4_gemm import (
    GemmConfig,
    choose_config,
    nvfp4_linear,
    nvfp4_to_fp8_block,
    prepare_nvfp4_weight,
)
from k3run.testing import rel_rms_error

NVFP4_SHAPES = [(7168, 7168), (12288, 7168), (7168, 12288), (3072, 3584), (3584, 3072)]  # (N, K)
NVFP4_MS = [1, 4, 16, 64, 4096]
FP8_SHAPES = [(7168, 7168), (2112, 7168), (6284, 7168)]  # 2112: MLA fused_qkv_a; 6284: KDA in_proj per TP8
FP8_MS = [1, 16, 64, 4096]


def decode_candidates() -> list[GemmConfig]:
    return [GemmConfig(block_n=bn, split_k=sk) for bn in (16, 32, 64) for sk in (1, 2, 4, 8)]


def prefill_candidates(m: int) -> list[GemmConfig]:
    tiles = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 128, 256, 4, 4), (64, 256, 128, 8, 3)]
    if m <= 64:
        tiles = [(64, 64, 128, 4, 4), (64, 128, 256, 4, 4), (32, 64, 256, 4, 4), (16, 128, 256, 4, 3)]
    out = [GemmConfig(block_m=a, block_n=b, block_k=c, num_warps=w, num_stages=s) for a, b, c, w, s in tiles]
    return [*out, GemmConfig(dequant_mm=True)]


def bench_nvfp4(rows: list[dict], copy_tbs: float, shapes, ms, sweep: bool) -> None:
    for n, k in shapes:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        nc = copies_for(wbytes)
        qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(nc)]
        pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]  # default layout
        # the sweep's explicit Triton configs read split128
        pws_split = (
            [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="split128") for q in qs]
            if sweep
            else pws
        )
        nb = copies_for(2 * n * k)
        w_bf16 = [
            dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
            for q in qs[:nb]
        ]
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            flop = 2 * m * n * k
            t_cublas = graph_ms([lambda w=w: F.linear(x, w) for w in w_bf16], 0.05)
            # the formats dequantizer validates codes with a host sync, so it cannot be graph-captured; at
            # ~1 ms per call launch overhead does not matter
            q0 = qs[0]
            t_naive = eager_ms(
                lambda: F.linear(
                    x, dequantize_nvfp4(q0.weight, q0.weight_scale, q0.weight_scale_2, dtype=torch.bfloat16)
                ),
                warmup=10,
                rep=50,
            )
            cfg = choose_config(m, n, k)
            cands = [cfg]
            if sweep and (n, k) in ((7168, 7168), (3072, 3584)) and m in (1, 16):
                cands += decode_candidates() if m <= 16 else prefill_candidates(m)
            best_t, best_cfg, t_default = float("inf"), cfg, float("nan")
            for c in cands:
                src = pws if c is cfg or c.dequant_mm else pws_split
                try:
                    t = graph_ms([lambda p=p, c=c: nvfp4_linear(x, p, config=c) for p in src], t_cublas / 3)
                except Exception as e:  # a config the compiler rejects (e.g. shared memory) is skipped
                    print(f"  skip {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if c is cfg:
                    t_default = t
                if t < best_t:
                    best_t, best_cfg = t, c
            exact = x.float() @ w_bf16[0].float().t()
            src = pws if best_cfg is cfg or best_cfg.dequant_mm else pws_split
            err = rel_rms_error(exact, nvfp4_linear(x, src[0], config=best_cfg).float())
            err_default = rel_rms_error(exact, nvfp4_linear(x, pws[0]).float())
            row = dict(
                kind="nvfp4", n=n, k=k, m=m, copies=nc, ms_default=t_default, ms_best=best_t,
                best=asdict(best_cfg), ms_cublas_bf16=t_cublas, ms_naive=t_naive, rel_err=err,
                rel_err_default=err_default, tbs=wbytes / best_t / 1e9, tbs_default=wbytes / t_default / 1e9,
                pct_copy=100 * wbytes / best_t / 1e9 / copy_tbs, tflops=flop / best_t / 1e9,
                tflops_cublas=flop / t_cublas / 1e9, x_cublas=t_cublas / best_t, x_naive=t_naive / best_t,
                x_cublas_default=t_cublas / t_default,
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def bench_fp8(rows: list[dict], shapes, ms) -> None:
    for n, k in shapes:
        n_pad = -(-n // 128) * 128
        n16 = -(-n // 16) * 16
        nc = copies_for(n_pad * k)
        ws, ss = [], []
        for _ in range(nc):
            q, scale = quantize_fp8_block(torch.randn(n, k, device="cuda"))
            w_pad = torch.zeros(n_pad, k, dtype=torch.float8_e4m3fn, device="cuda")
            w_pad[:n] = q
            ws.append(w_pad)
            ss.append(scale.reshape(scale.shape[0], scale.shape[2]).contiguous())
        w_bf16 = [dequantize_fp8_block(w[:n], s, torch.bfloat16) for w, s in zip(ws[:2], ss[:2])]
        bias = torch.randn(n, device="cuda").bfloat16()
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, sx = quantize_act_1x128(x, m_multiple=4, scale_outer_major=True)
            flop = 2 * m * n * k
            wsp = list(zip(ws, ss))

            def bare(w, s, rows_n=n_pad):
                return torch._scaled_mm(
                    xq, w[:rows_n].t(), scale_a=sx, scale_b=s.t(), out_dtype=torch.bfloat16
                )

            t_bare = graph_ms([lambda w=w, s=s: bare(w, s) for w, s in wsp], 0.05)
            t_view = graph_ms([lambda w=w, s=s: bare(w, s, n16) for w, s in wsp], 0.05)
            try:  # can cuBLAS add the bias in its epilogue for block-wise scaling?
                b16 = torch.randn(n16, device="cuda").bfloat16()
                got = torch._scaled_mm(
                    xq, ws[0][:n16].t(), scale_a=sx, scale_b=ss[0].t(), bias=b16, out_dtype=torch.bfloat16
                )
                plain = bare(ws[0], ss[0], n16)
                bias_in_gemm = (
                    f"accepted, rel err {rel_rms_error((plain.float() + b16.float()), got.float()):.1e}"
                )
            except RuntimeError as e:
                bias_in_gemm = f"refused: {str(e)[:100]}"
            quant_t = {}
            for bm, g, nw in ((4, 4, 4), (4, 8, 8), (8, 8, 8)):
                quant_t[f"{bm}x{g}w{nw}"] = graph_ms(
                    [lambda: fp8_act_quant(x, m_multiple=4, scale_outer_major=True, block_m=bm,
                                           groups_per_program=g, num_warps=nw)], 0.01)  # fmt: skip
            t_layer = graph_ms([lambda w=w, s=s: fp8_pb_wo_linear(x, w, s, n, bias) for w, s in wsp], 0.05)
            t_layer_nb = graph_ms([lambda w=w, s=s: fp8_pb_wo_linear(x, w, s, n) for w, s in wsp], 0.05)
            t_triton = graph_ms(
                [lambda w=w, s=s: fp8_pb_wo_linear(x, w, s, n, bias, backend="triton") for w, s in wsp], 0.05
            )
            t_cublas = graph_ms([lambda w=w: F.linear(x, w, bias) for w in w_bf16], 0.05)
            ref = fp8_pb_wo_linear_ref(x.float(), ws[0], ss[0], n, bias.float())
            err_sm = rel_rms_error(ref, fp8_pb_wo_linear(x, ws[0], ss[0], n, bias).float())
            err_tr = rel_rms_error(ref, fp8_pb_wo_linear(x, ws[0], ss[0], n, bias, backend="triton").float())
            row = dict(
                kind="fp8_pb_wo", n=n, k=k, m=m, copies=nc, ms_bare=t_bare, ms_bare_view=t_view,
                ms_quant=min(quant_t.values()), quant_configs=quant_t, ms_layer=t_layer,
                ms_layer_nobias=t_layer_nb, ms_triton=t_triton, ms_cublas_bf16=t_cublas,
                tflops_bare=flop / t_bare / 1e9, tflops_layer=flop / t_layer / 1e9,
                tflops_triton=flop / t_triton / 1e9, layer_over_bare=t_layer / t_bare,
                layer_nb_over_bare=t_layer_nb / t_bare, err_scaled_mm=err_sm, err_triton=err_tr,
                bias_in_scaled_mm=bias_in_gemm,
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def bench_nvfp4_via_fp8(rows: list[dict], ms) -> None:
    """Issue 6 section 2: NVFP4 converted to 128x128 FP8 blocks at load time; accuracy cost and speed."""
    n, k = 7168, 7168
    nc = copies_for(n * k)
    qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(nc)]
    fp8 = [nvfp4_to_fp8_block(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
    pws = [prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2) for q in qs]
    w32 = dequantize_nvfp4(qs[0].weight, qs[0].weight_scale, qs[0].weight_scale_2)
    w_bf16 = [w32.bfloat16(), w32.bfloat16().clone()]
    w_err = rel_rms_error(w32, dequantize_fp8_block(*fp8[0]))
    for m in ms:
        x = torch.randn(m, k, device="cuda").bfloat16()
        exact = x.float() @ w32.t()
        t_fp8 = graph_ms([lambda f=f: fp8_pb_wo_linear(x, f[0], f[1], n) for f in fp8], 0.05)
        t_nv = graph_ms([lambda p=p: nvfp4_linear(x, p) for p in pws], 0.05)
        t_cublas = graph_ms([lambda w=w: F.linear(x, w) for w in w_bf16], 0.05)
        row = dict(
            kind="nvfp4_as_fp8", n=n, k=k, m=m, weight_rel_err=w_err,
            out_err_fp8=rel_rms_error(exact, fp8_pb_wo_linear(x, fp8[0][0], fp8[0][1], n).float()),
            out_err_nvfp4=rel_rms_error(exact, nvfp4_linear(x, pws[0]).float()),
            ms_fp8=t_fp8, ms_nvfp4=t_nv, ms_cublas_bf16=t_cublas,
            tflops_fp8=2 * m * n * k / t_fp8 / 1e9, x_cublas=t_cublas / t_fp8,
        )  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)


def _cfg_name(b: dict) -> str:
    if b["dequant_mm"]:
        return "dequant+cuBLAS"
    if b.get("gemv"):
        return f"gemv w{b['num_warps']} sk{b['split_k']} st{b.get('smem_stages', 2)}"
    tile = f"{b['block_m']}x{b['block_n']}x{b['block_k']}"
    return f"{tile} w{b['num_warps']} s{b['num_stages']} d{b['decode']} sk{b.get('split_k', 1)}"


def table(rows: list[dict], copy_tbs: float) -> str:
    lines = [
        f"copy bandwidth (read+write): {copy_tbs:.2f} TB/s",
        "",
        "NVFP4 W4A16 (best config tried; dflt = choose_config; err vs the exactly dequantized weight)",
        f"{'N x K':>13} {'M':>5} {'ms':>8} {'ms dflt':>8} {'TB/s':>6} {'%copy':>6} {'TFLOP/s':>8} "
        f"{'cuBLAS':>8} {'x cuBLAS':>8} {'x dflt':>7} {'x naive':>8} {'err':>8}  best config",
    ]
    for r in rows:
        if r["kind"] == "nvfp4":
            lines.append(
                f"{r['n']:>6}x{r['k']:<6} {r['m']:>5} {r['ms_best']:8.4f} {r['ms_default']:8.4f} "
                f"{r['tbs']:6.2f} {r['pct_copy']:6.1f} {r['tflops']:8.1f} {r['ms_cublas_bf16']:8.4f} "
                f"{r['x_cublas']:8.2f} {r['x_cublas_default']:7.2f} {r['x_naive']:8.1f} {r['rel_err']:8.1e}  "
                f"{_cfg_name(r['best'])}"
            )
    lines += [
        "",
        "FP8_PB_WO (layer = 1x128 quant + block _scaled_mm + crop + bias; bare = _scaled_mm, x quantized)",
        f"{'N x K':>13} {'M':>5} {'bare ms':>8} {'view ms':>8} {'quant':>8} {'layer':>8} {'no-bias':>8} "
        f"{'lay/bare':>8} {'nb/bare':>8} {'triton':>8} {'bf16':>8} {'TF bare':>8} {'TF layer':>8} "
        f"{'TF trit':>8} {'err sm':>8} {'err tr':>8}",
    ]
    for r in rows:
        if r["kind"] == "fp8_pb_wo":
            lines.append(
                f"{r['n']:>6}x{r['k']:<6} {r['m']:>5} {r['ms_bare']:8.4f} {r['ms_bare_view']:8.4f} "
                f"{r['ms_quant']:8.4f} {r['ms_layer']:8.4f} {r['ms_layer_nobias']:8.4f} "
                f"{r['layer_over_bare']:8.2f} {r['layer_nb_over_bare']:8.2f} {r['ms_triton']:8.4f} "
                f"{r['ms_cublas_bf16']:8.4f} {r['tflops_bare']:8.1f} {r['tflops_layer']:8.1f} "
                f"{r['tflops_triton']:8.1f} {r['err_scaled_mm']:8.1e} {r['err_triton']:8.1e}"
            )
    lines += [
        "",
        "NVFP4 converted to FP8 blocks at load (7168x7168; errors vs the exact NVFP4 product)",
        f"{'M':>5} {'w err':>8} {'out err fp8':>11} {'out err nvfp4':>13} {'fp8 ms':>8} {'nvfp4 ms':>8} "
        f"{'bf16 ms':>8} {'TF fp8':>8} {'x cuBLAS':>8}",
    ]
    for r in rows:
        if r["kind"] == "nvfp4_as_fp8":
            lines.append(
                f"{r['m']:>5} {r['weight_rel_err']:8.1e} {r['out_err_fp8']:11.1e} {r['out_err_nvfp4']:13.1e} "
                f"{r['ms_fp8']:8.4f} {r['ms_nvfp4']:8.4f} {r['ms_cublas_bf16']:8.4f} {r['tflops_fp8']:8.1f} "
                f"{r['x_cublas']:8.2f}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for the log and JSON")
    ap.add_argument("--quick", action="store_true", help="two shapes and a few M only")
    ap.add_argument("--sweep", action="store_true", help="also try the candidate launch configurations")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: nvfp4,fp8,nvfp4_fp8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    skip = set(filter(None, args.skip.split(",")))
    copy_tbs = copy_bandwidth()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s", flush=True)
    rows: list[dict] = []
    nv_shapes, nv_ms, fp_shapes, fp_ms = NVFP4_SHAPES, NVFP4_MS, FP8_SHAPES, FP8_MS
    if args.quick:
        nv_shapes, nv_ms, fp_shapes, fp_ms = NVFP4_SHAPES[::3], [1, 16, 4096], FP8_SHAPES[:2], [1, 4096]
    if "nvfp4" not in skip:
        bench_nvfp4(rows, copy_tbs, nv_shapes, nv_ms, args.sweep)
    if "fp8" not in skip:
        bench_fp8(rows, fp_shapes, fp_ms)
    if "nvfp4_fp8" not in skip:
        bench_nvfp4_via_fp8(rows, [16, 4096])
    text = table(rows, copy_tbs)
    header = (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, cmd: {' '.join(sys.argv)}"
    )
    with open(os.path.join(args.out, "bench_linear.json"), "w") as f:
        json.dump(dict(header=header, copy_tbs=copy_tbs, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "bench_linear.txt"), "w") as f:
        f.write(header + "\n" + text + "\n")
    print(header)
    print(text)


if __name__ == "__main__":
    main()
