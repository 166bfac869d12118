"""Question: does the weights' storage order limit the Gluon NVFP4 decode kernel: would each 16-row K tile
stored as one contiguous 1 KB block (`tile_split128`) stream faster than split128's 16 pieces K_pad/2 apart?

Answer: by 10-15%, not the 2x needed (bench/RESULTS.md "Runs 12-16", run 14; NOTES.md "v4"): the cp.async
kernel on the tiled layout took 15.22 against 17.47 us on 7168^2 at M = 1 (1.90 TB/s, 1.88x cuBLAS bf16) and
23.25 against 26.89 us on 12288x7168 (2.13 TB/s, 2.02x), bit-identical; ncu put DRAM at 31-34% of peak and the
limit on the integer ALU pipe with ~3 warps per scheduler. The tiled order became tiled128 (default, sm_89+).

Times, in one run and with the same method as bench_gemv.py (CUDA graphs over L2-busting weight copies):
the register-prefetch kernel and the cp.async kernel on the split128 layout (each 16-row block's K tile is
16 pieces of 64 bytes, K_pad/2 bytes apart) and the cp.async kernel on `tile_split128` (each K tile one
contiguous 1 KB block, a program's tiles back to back), against cuBLAS bf16. Checks the tiled results are
bit-identical to the split128 ones (same decode, same summation order).

    PYTHONPATH=src python bench/probes/gemv_layout.py [--ncu]   (--ncu: one call of each, for ncu to profile)
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, copy_bandwidth, graph_ms  # noqa: E402

from k3run.formats import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight  # noqa: E402
from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv, tile_split128  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402

SHAPES = [(7168, 7168), (12288, 7168), (7168, 12288), (3072, 3584)]


def variants():
    """The register-prefetch kernel and the cp.async kernel on split128 as baselines, then the cp.async
    kernel on the tiled layout over stages x two accumulators x a register cap of 80 (25 warps per SM
    instead of ~21) x split_k (the largest divisor of the 128-wide chunk count at or below the value)."""
    out = [("reg sk4", dict(split_k=4, depth=1, block_k=128)), ("smem st2 sk8", dict(split_k=8, stages=2))]
    for st in (2, 4):
        for acc2 in (False, True):
            for reg in (None, 80):
                for sk in (4, 8, 16):
                    name = f"tiled st{st} sk{sk}{' acc2' if acc2 else ''}{' r80' if reg else ''}"
                    out.append((name, dict(split_k=sk, stages=st, tiled=True, acc2=acc2, maxnreg=reg)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.ncu:  # one launch per variant at 7168^2, M = 1 (plus cuBLAS), nothing else on the GPU
        q = quantize_nvfp4(torch.randn(7168, 7168, device="cuda"))
        pw = prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="split128")
        tw, ts = tile_split128(pw.weight, pw.scale_bits)
        wb = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
        x = torch.randn(1, 7168, device="cuda").bfloat16()
        best = dict(split_k=8, stages=2, tiled=True, acc2=True, maxnreg=80)
        for name, kw in [
            ("tiled st2 sk4", dict(split_k=4, stages=2, tiled=True)),
            ("tiled st2 sk8 acc2 r80", best),
        ]:
            w, s = (tw, ts) if kw.get("tiled") else (pw.weight, pw.scale_bits)
            nvfp4_gemv(x, w, s, pw.global_scale, **kw)
            torch.cuda.synchronize()
            print("profiled", name, flush=True)
        F.linear(x, wb)
        torch.cuda.synchronize()
        return
    copy_tbs = copy_bandwidth()
    print(f"copy bandwidth {copy_tbs:.2f} TB/s")
    lines = []
    for n, k in SHAPES:
        wbytes = n * k * BYTES_PER_NVFP4_WEIGHT
        nc = copies_for(wbytes)
        qs = [quantize_nvfp4(torch.randn(n, k, device="cuda")) for _ in range(nc)]
        pws = [
            prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="split128") for q in qs
        ]
        tiled = [tile_split128(p.weight, p.scale_bits) for p in pws]
        wbf = [
            dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.bfloat16)
            for q in qs[: copies_for(2 * n * k)]
        ]
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            t_cublas = graph_ms([lambda w=w: F.linear(x, w) for w in wbf], 0.05)
            ref = nvfp4_gemv(x, pws[0].weight, pws[0].scale_bits, pws[0].global_scale, split_k=4, stages=4)
            row = [f"{n:>5}x{k:<6} {m:>3} cuBLAS {t_cublas * 1e3:6.2f}"]
            best = (float("inf"), "")
            for name, kw in variants():
                src = [
                    (tw, ts) if kw.get("tiled") else (p.weight, p.scale_bits)
                    for p, (tw, ts) in zip(pws, tiled)
                ]
                y = nvfp4_gemv(x, *src[0], pws[0].global_scale, **kw)
                if kw.get("tiled") and kw["split_k"] == 4 and not kw["acc2"]:  # same summation order
                    assert torch.equal(y, ref), f"{name}: differs from the split128 result"
                err = rel_rms_error(ref.float(), y.float())
                assert err < 2**-7, f"{name}: {err:.2e} from the split128 result (bf16 rounding is < 2^-8)"
                t = graph_ms(
                    [
                        lambda w=w, s=s, g=p.global_scale: nvfp4_gemv(x, w, s, g, **kw)
                        for (w, s), p in zip(src, pws)
                    ],
                    t_cublas / 3,
                )
                row.append(f"{name} {t * 1e3:6.2f} ({wbytes / t / 1e9:4.2f} TB/s, {t_cublas / t:4.2f}x)")
                best = min(best, (t, name))
            print(" | ".join(row), flush=True)
            t, name = best
            lines.append(
                f"{n:>5}x{k:<6} {m:>3} cuBLAS {t_cublas * 1e3:6.2f} us | best {name}: {t * 1e3:6.2f} us "
                f"{wbytes / t / 1e9:4.2f} TB/s ({100 * wbytes / t / 1e9 / copy_tbs:4.1f}% of copy) "
                f"{t_cublas / t:4.2f}x cuBLAS | {row[1]} | {row[2]}"
            )
    print(f"\n{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s; us per call (TB/s, x cuBLAS bf16)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
