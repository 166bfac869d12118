"""Question: where does a CTA of the sm_90 CUDA NVFP4 GEMM (kernels/nvfp4_gemm/w4a16_sm90.cu) spend its
time? Run 123 measured ~1 us per 128-wide K chunk per CTA at both M = 16 (BT 16, eight tiny m64n16k16 wgmma a
chunk) and M = 256 (BT 256), 2-4x session 30's prediction; the bytes and the MMA work differ 16x between the
two, so a fixed cost per chunk is the suspect. This probe launches the kernel a few times on one shape and
config so that ncu can profile one launch (stall reasons per SASS line):

    ncu --clock-control none -k regex:w4a16_kernel --launch-skip 3 --launch-count 1 --set full \
        -o rep python3 bench/probes/sm90_ncu.py --m 16 --config 16,1,2,8
    ncu -i rep.ncu-rep --page details; ncu -i rep.ncu-rep --page source --csv --print-source sass

It only launches; bench/bench_sm90_gemm.py times the kernel. Answer: bench/NOTES.md session 32 (run 125).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from k3run.formats import quantize_nvfp4
    from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--config", default="", help="BT,warpgroups,split_k,stages (default: sm90_config)")
    ap.add_argument("--launches", type=int, default=6)
    args = ap.parse_args()
    assert sm90.available(), sm90._error
    q = quantize_nvfp4(torch.randn(args.n, args.k, device="cuda"))
    tw = prepare_nvfp4_weight(q.weight, q.weight_scale, q.weight_scale_2, layout="tiled128")
    x = torch.randn(args.m, args.k, device="cuda").to(torch.bfloat16)
    cfg = tuple(int(v) for v in args.config.split(",")) if args.config else None

    def call():
        return sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, args.k, args.n, config=cfg)

    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    print(f"{args.n}x{args.k} M={args.m} config {cfg or 'sm90_config'}: {args.launches} launches")


if __name__ == "__main__":
    main()
