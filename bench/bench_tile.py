"""The NVFP4 tile GEMM (kernels/nvfp4_gemm/tile.py) against its baselines, in one process on one GPU.

Stages (all by default; --stages picks):
- dense: NVFP4 linears at M = 16..4096 on K3 and Kimi Linear shapes: the tile GEMM over a few launch
  configs, the decode kernel where it runs (M <= 64), dequantize + cuBLAS, and cuBLAS on a bf16 copy of the
  weight (the tensor-core ceiling in practice; the bf16 dense peak is printed beside it). Each timed as CUDA
  graphs of back-to-back calls rotating over weight copies that overflow the L2 (common.graph_ms).
- moe: routed experts at prefill sizes: K3's latent experts (3584 -> 3072, top-16, 56 local as at EP16)
  and Kimi Linear's (2304 -> 1024, top-8, 256), T = 256 / 1024 / 4096 tokens: the tile GEMM's two grouped
  launches (GEMM1 with the activation in its epilogue, + the device-side grouping) for several block
  sizes, the per-expert loop (eager, what prefill ran before), and torch._grouped_mm on bf16 copies of
  the experts (HF transformers' path; the two GEMMs only, picks pre-sorted). TFLOP/s counted as
  2 * T * top_k * 3 * D * I.
- model: time to first token of one prompt (2048 and 8192 tokens) through the engine on a K3-shaped 4-layer
  random model and on a full-depth random Kimi Linear 48B-A3B NVFP4 (bench/k3_shaped.py), with the tile
  paths and (2048 tokens) with the paths before them (the per-expert loop above 128 tokens, dequantize +
  cuBLAS linears).

    PYTHONPATH=src python bench/bench_tile.py [--stages dense,moe,model] [--quick]
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_grouped import experts as random_experts  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, prepare_nvfp4_weight  # noqa: E402
from k3run.kernels.nvfp4_gemm.tile import expert_blocks, nvfp4_tile_gemm, nvfp4_tile_gemm_grouped  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0  # the datasheet's dense bf16 tensor-core peak (H100/H200 SXM)
DENSE_SHAPES = [(7168, 7168), (12288, 7168), (7168, 12288), (4096, 2304), (2304, 4096)]
DENSE_MS = [16, 32, 64, 128, 256, 1024, 4096]
# (BM rows of x, BN weight rows, num_warps, num_stages): BN is the wgmma M (64 per warpgroup)
TILE_CONFIGS = [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3), (64, 64, 4, 4),
                (128, 64, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4)]  # fmt: skip
ROWS: list[dict] = []


def random_weight(n: int, k: int):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    s = torch.randint(0x28, 0x48, (n, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    return prepare_nvfp4_weight(w, s, torch.tensor([2e-3], device="cuda"), layout="tiled128")


def dense(quick: bool) -> None:
    shapes = DENSE_SHAPES[:2] if quick else DENSE_SHAPES
    for n, k in shapes:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        ws = [random_weight(n, k) for _ in range(copies_for(wbytes))]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(n * k * 2))]
        for m in DENSE_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flops = 2 * m * n * k
            est = max(flops / 400e12, wbytes / 3e12) * 1e3
            ref = nvfp4_linear(x, ws[0], config=GemmConfig(dequant_mm=True))
            res = {"stage": "dense", "n": n, "k": k, "m": m}
            res["cublas_bf16_us"] = graph_ms([lambda w=w: F.linear(x, w) for w in wb], est) * 1e3
            res["dequant_cublas_us"] = (
                graph_ms(
                    [lambda w=w: nvfp4_linear(x, w, config=GemmConfig(dequant_mm=True)) for w in ws], est
                )
                * 1e3
            )
            res["auto_us"] = graph_ms([lambda w=w: nvfp4_linear(x, w) for w in ws], est) * 1e3
            best = None
            for cfg in TILE_CONFIGS:
                if cfg[0] > 2 * max(m, 16):
                    continue
                try:
                    y = nvfp4_tile_gemm(
                        x, ws[0].weight, ws[0].scale_bits, ws[0].global_scale, k, n, config=cfg
                    )
                    err = rel_rms_error(ref.float(), y.float())
                    us = graph_ms(
                        [
                            lambda w=w: nvfp4_tile_gemm(
                                x, w.weight, w.scale_bits, w.global_scale, k, n, config=cfg
                            )
                            for w in ws
                        ],
                        est,
                    ) * 1e3  # fmt: skip
                except Exception as e:  # noqa: BLE001 (a config that fails to compile is reported, not fatal)
                    res[f"tile_{cfg}"] = f"error {type(e).__name__}: {str(e)[:200]}"
                    continue
                res[f"tile_{cfg}_us"] = us
                res[f"tile_{cfg}_err"] = err
                if best is None or us < best[1]:
                    best = (cfg, us)
            if best:
                res["tile_best"], res["tile_best_us"] = str(best[0]), best[1]
                t = best[1]
                tf = flops / t / 1e6
                print(
                    f"dense {n}x{k} M={m:5d}: tile {t:8.1f} us {best[0]} | auto {res['auto_us']:8.1f} | "
                    f"deq+cuBLAS {res['dequant_cublas_us']:8.1f} | cuBLAS bf16 {res['cublas_bf16_us']:8.1f}"
                    f" | x cuBLAS {res['cublas_bf16_us'] / t:.2f} x deq {res['dequant_cublas_us'] / t:.2f} | "
                    f"{tf:6.0f} TFLOP/s ({tf / H200_BF16_DENSE_TFLOPS:.0%} of peak), "
                    f"{wbytes / t / 1e6:.2f} TB/s weights",
                    flush=True,
                )
            ROWS.append(res)
        del ws, wb
        torch.cuda.empty_cache()


MOE_SHAPES = {"k3": (3584, 3072, 56, 16), "kimi_linear": (2304, 1024, 256, 8)}  # D, I, E_local, top-k


def moe(quick: bool) -> None:
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import fused_experts

    for name, (d, i, e, a) in MOE_SHAPES.items():
        act = GatedActivation("situ", 4.0, 25.0) if name == "k3" else GatedActivation("silu")
        ex = random_experts(e, d, i, act)
        gs13, gs2 = ex.scheme.kernel_scales
        s13, s2 = ex.w13_weight_scale.view(torch.uint8), ex.w2_weight_scale.view(torch.uint8)
        wb13 = torch.randn(e, 2 * i, d, device="cuda", dtype=torch.bfloat16)
        wb2 = torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16)
        for t in [256, 1024] if quick else [256, 1024, 4096]:
            g = torch.Generator(device="cuda").manual_seed(t)
            x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = torch.randn(t, e, device="cuda", generator=g)
            weights, ids = torch.topk(torch.sigmoid(logits), a, dim=-1)
            picks = t * a
            flops = 2 * picks * 3 * d * i
            est = flops / 300e12 * 1e3
            res = {"stage": "moe", "model": name, "t": t, "d": d, "i": i, "e": e, "top_k": a}
            local = ids.reshape(-1).to(torch.int32)
            full = fused_experts(ex, x, ids, weights)  # the tile path (t >= TILE_FROM_TOKENS) or decode
            res["engine_path_us"] = graph_ms([lambda: fused_experts(ex, x, ids, weights)], est) * 1e3
            t0 = time.perf_counter()
            reps = 2 if t >= 1024 else 3
            for _ in range(reps):
                loop = fused_experts(ex, x, ids, weights, grouped=False)
            torch.cuda.synchronize()
            res["loop_us"] = (time.perf_counter() - t0) / reps * 1e6
            res["engine_vs_loop_err"] = rel_rms_error(loop, full)
            actv = (act.kind, act.beta, act.linear_beta)
            for bm in (16, 64, 128):
                for cfg in ((128, 4, 3), (128, 8, 3), (64, 4, 3)):

                    def gemms():
                        grp = expert_blocks(local, e, bm)
                        h = nvfp4_tile_gemm_grouped(
                            x, ex.w13_weight, s13, gs13, grp, picks=picks, x_div=a, k=d, config=cfg,
                            out=torch.empty(picks, i, device="cuda", dtype=torch.bfloat16), activation=actv,
                        )  # fmt: skip
                        return nvfp4_tile_gemm_grouped(
                            h, ex.w2_weight, s2, gs2, grp, picks=picks, x_div=1, k=i, config=cfg,
                            out=torch.empty(picks, d, device="cuda", dtype=torch.bfloat16),
                        )  # fmt: skip

                    try:
                        us = graph_ms([gemms], est) * 1e3
                    except Exception as err:  # noqa: BLE001
                        res[f"tile_bm{bm}_{cfg}"] = f"error {type(err).__name__}: {str(err)[:200]}"
                        continue
                    res[f"tile_bm{bm}_{cfg}_us"] = us
            tile_keys = [k for k in res if k.startswith("tile_bm") and k.endswith("_us")]
            best = min(tile_keys, key=res.__getitem__) if tile_keys else None
            # bf16 grouped GEMM: picks sorted by expert, offsets = cumulative counts
            order = torch.argsort(local, stable=True)
            xs = x[order // a]
            counts = torch.bincount(local, minlength=e)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            try:

                def grouped_bf16():
                    gu = torch._grouped_mm(xs, wb13.transpose(1, 2), offs=offs)
                    return torch._grouped_mm(gu[:, :i].contiguous(), wb2.transpose(1, 2), offs=offs)

                res["grouped_mm_bf16_us"] = graph_ms([grouped_bf16], est) * 1e3
            except Exception as err:  # noqa: BLE001
                res["grouped_mm_bf16"] = f"error {type(err).__name__}: {str(err)[:200]}"
            line = f"moe {name} T={t:5d}: engine {res['engine_path_us']:9.1f} us"
            line += f" ({flops / res['engine_path_us'] / 1e6:5.0f} TFLOP/s) | loop {res['loop_us']:10.1f} us"
            line += f" (x{res['loop_us'] / res['engine_path_us']:.1f}) err {res['engine_vs_loop_err']:.1e}"
            if best:
                line += (
                    f" | best GEMMs {res[best]:8.1f} us {best[5:-3]} ({flops / res[best] / 1e6:5.0f} TFLOP/s)"
                )
            if "grouped_mm_bf16_us" in res:
                gm = res["grouped_mm_bf16_us"]
                line += f" | _grouped_mm bf16 {gm:8.1f} us ({flops / gm / 1e6:5.0f} TFLOP/s)"
            print(line, flush=True)
            ROWS.append(res)
        torch.cuda.empty_cache()


def model(quick: bool) -> None:
    from k3_shaped import kimi_linear_48b_config, random_k3_model, random_model

    import k3run.kernels.nvfp4_gemm as ng
    from k3run.engine.llm import LLM, EngineConfig
    from k3run.engine.sequence import SamplingParams
    from k3run.layers import moe as moe_mod
    from k3run.quant import experts as schemes
    from k3run.tokenizer import load_tokenizer

    tok = load_tokenizer("assets/default-model-k3-mixed")
    saved = (schemes.TILE_FROM_TOKENS, ng.TILE_MAX_M, moe_mod.FusedExperts.grouped_ok)

    def before(on: bool) -> None:
        """The paths before the tile GEMM: the per-expert loop above 128 tokens, dequantize + cuBLAS."""
        if on:
            schemes.TILE_FROM_TOKENS, ng.TILE_MAX_M = 1 << 30, 0
            moe_mod.FusedExperts.grouped_ok = lambda self, x: saved[2](self, x) and x.shape[0] <= 128
        else:
            schemes.TILE_FROM_TOKENS, ng.TILE_MAX_M, moe_mod.FusedExperts.grouped_ok = saved

    models = (
        []
        if quick
        else [("k3-shaped 4 layers, 64 experts", lambda: random_k3_model(4, 64, device="cuda"), [2048, 8192])]
    )
    full = [2048, 8192]
    models.append(
        ("Kimi Linear 48B-A3B NVFP4, 27 layers, 256 experts (random, in memory)",
         lambda: random_model(kimi_linear_48b_config(), device="cuda"), full)
    )  # fmt: skip
    for name, build, lens in models:
        t0 = time.perf_counter()
        m = build()
        print(f"model {name}: built in {time.perf_counter() - t0:.0f} s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)  # fmt: skip
        cfg = EngineConfig(max_num_seqs=1, max_model_len=max(lens) + 16, max_num_batched_tokens=8192)
        llm = LLM.from_model(m, tok, cfg)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for mode in ("tile", "before"):
            before(mode == "before")
            for n in lens if mode == "tile" else lens[:1]:
                prompt = torch.randint(10, 2000, (n,)).tolist()
                llm.generate([prompt], params)  # warm-up (compiles)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate([prompt], params)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                what = f"model {name}, {mode}: prompt {n}"
                print(f"{what} -> first token {dt * 1e3:.1f} ms ({n / dt:.0f} tok/s)", flush=True)
                ROWS.append({"stage": "model", "model": name, "mode": mode, "prompt": n, "ttft_s": dt})
            before(False)
        del llm, m
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="dense,moe,model")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_bandwidth():.2f} TB/s", flush=True)
    for stage in args.stages.split(","):
        try:
            {"dense": dense, "moe": moe, "model": model}[stage](args.quick)
        except Exception as e:  # noqa: BLE001 (the next stage still runs)
            import traceback

            traceback.print_exc()
            print(f"stage {stage} failed: {e}", flush=True)
        with open(os.path.join(args.out, "bench_tile.json"), "w") as f:
            json.dump(ROWS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
