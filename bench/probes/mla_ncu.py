"""Question: where does the MLA decode launch's time go at one sequence of a long context (H100, run 233: 26.8
us at 8K and 48.9 at 32K for 3.1 / 12.4 us of cached latents at 32 heads): the split programs (their query
loads, their 64-position blocks, their partial writes) or the merge? This probe makes the engine's launch
(`mla_decode_triton` at `decode_config`) a few times so that ncu can profile one of each kernel (duration,
DRAM throughput, occupancy, stall reasons per SASS line):

    ncu --clock-control none -k regex:_mla_ --launch-skip 6 --launch-count 2 --set full \
        -o rep python3 bench/probes/mla_ncu.py --batch 1 --ctx 8192 --heads 32
    ncu -i rep.ncu-rep --page details

Random bf16 latents, every sequence at --ctx positions in the graph decoder's window (the next power of two
above it). It only launches; bench/bench_mla_decode.py times the same launch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_mla_decode import _window

    from k3run.kernels.mla.triton import choose_splits, decode_config, mla_decode_triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args()
    L, R = 512, 64
    b, ctx, h = args.batch, args.ctx, args.heads
    window = _window(ctx)
    g = torch.Generator(device="cuda").manual_seed(0)
    store = torch.randn(b, window, L + R, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(b, device="cuda", generator=g)
    lens = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
    q_lat = torch.randn(b, h, L, device="cuda", generator=g) / L**0.5
    q_pe = torch.randn(b, h, R, device="cuda", generator=g) / R**0.5
    for _ in range(args.launches):
        mla_decode_triton(q_lat, q_pe, store, slots, lens, window, (128 + R) ** -0.5)
    torch.cuda.synchronize()
    cfg = decode_config(b, window, h)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_splits(b, window, -(-h // cfg["block_h"]), sms, cfg["min_chunk"], cfg["per_sm"])
    laid = "shared by length" if cfg["shared"] else f"{splits} splits"
    print(f"MLA decode, {b} x {ctx} positions (window {window}), {h} heads: {cfg}, {laid}")


if __name__ == "__main__":
    main()
