"""How fast the CUDA C++ NVFP4 GEMM's ring is fed (w4a16_sm90.cu) when its consumers do no work: the GEMM
built a second time with consume()'s decode and wgmma group removed (each chunk still waits for its slot,
reads one word of it and releases the previous slot, as the GEMM does), timed beside the real GEMM on the
same weights, configs and launches.

Why (bench/NOTES.md, session 42): sm90_isolate measured the consumer's chunk from shared memory at 408
cycles (BT 64) and 301-479 (BT 16), while the GEMM spends ~790 and ~1240 cycles a chunk at 64 and 16 rows of
7168^2. If the feed-only launch takes about as long as the GEMM, the producer / ring / L2 / DRAM side binds
at 16-64 rows and the consumer's work is hidden behind it; if it is much faster, the two sides do not
overlap (the consumer waits, then the producer waits).

    PYTHONPATH=src python3 bench/probes/sm90_feed.py [--shapes 7168x7168,12288x7168] [--out FILE]

Prints, per (shape, M, config): us of the GEMM, of the feed-only launch, their ratio, the bytes the ring
moves per launch (weights + scales from DRAM, the x tile of every chunk from L2) and both as TB/s. Needs an
sm_90 GPU and nvcc; builds the feed-only extension (~1 min) while the GEMM's own builds.
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_wgmma import _weights  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, graph_ms  # noqa: E402

# consume()'s work in w4a16_sm90.cu; the feed-only build replaces it with one shared load of the slot
WORK = (
    "  decode_chunk<BF16>(r.w0 + st * SM::W, r.s0 + st * SM::S, a);\n"
    "  issue_chunk<BT, BF16>(r.desc0, uint32_t(st * SM::X), acc, a);\n"
)
FEED = "  acc[0] += __uint_as_float(lds32(r.w0 + st * SM::W) & 1u);\n"
# the warp / thread producers' block address; the "contiguous" build reads the same tile's bytes in
# chunk-major order (a chunk's nrb row blocks as one run of nrb KB, not nrb 1 KB pieces CH KB apart): a
# DRAM-locality test (the data land in other slots, so only the feed-only timing means anything)
BLOCK = "const size_t blk = size_t(g.rb0 + rb) * CH + c;"
BLOCK_CONTIGUOUS = "const size_t blk = size_t(g.rb0) * CH + size_t(c) * g.nrb + rb;"

# (M, config) per shape: the configs the engine takes at 16 / 32 / 64 / 128 / 256 rows and their neighbours
CASES = (
    (16, (16, 1, 2, 8)),
    (16, (16, 1, 1, 8)),
    (32, (32, 1, 2, 6)),
    (64, (64, 1, 1, 8)),
    (64, (64, 1, 1, 4)),
    (64, (64, 2, 2, 6)),
    (128, (128, 1, 1, 6)),
    (256, (128, 2, 1, 4)),
)


def feed_source(contiguous: bool = False) -> str:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    src = sm90.cuda_source()
    if WORK not in src or src.count(BLOCK) != 2:
        raise RuntimeError(
            "sm90_feed: consume()'s work or the producers' block address moved in w4a16_sm90.cu"
        )
    src = src.replace(WORK, FEED)
    return src.replace(BLOCK, BLOCK_CONTIGUOUS) if contiguous else src


def build_feed(contiguous: bool = False):
    from torch.utils.cpp_extension import load_inline

    decls = (
        "int w4a16_smem_bytes(int64_t bt, int64_t nwg, int64_t stages);\n"
        "torch::Tensor w4a16_prep_x(torch::Tensor x, int64_t bt, int64_t chunks);\n"
        "void w4a16_gemm(torch::Tensor xt, torch::Tensor w, torch::Tensor s, torch::Tensor gs, "
        "c10::optional<torch::Tensor> bias, torch::Tensor y, torch::Tensor ws, torch::Tensor cnt, int64_t M, "
        "int64_t N, int64_t bt, int64_t nwg, int64_t split, int64_t stages, int64_t producer, "
        "int64_t sk);\n"
    )
    return load_inline(
        name="k3run_sm90_feed" + ("_contiguous" if contiguous else ""),
        cpp_sources=decls,
        cuda_sources=feed_source(contiguous),
        functions=["w4a16_smem_bytes", "w4a16_prep_x", "w4a16_gemm"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False,
    )


def ring_bytes(m: int, n: int, k: int, cfg: tuple[int, int, int, int]) -> tuple[float, float]:
    """(DRAM bytes: codes + scales once; L2 -> SM bytes: every CTA's x tile of every chunk + the codes)."""
    bt, nwg = cfg[0], cfg[1]
    w = n * k * BYTES_PER_NVFP4_WEIGHT
    x = -(-n // (64 * nwg)) * -(-m // bt) * -(-k // 128) * 2 * bt * 128  # tiles x chunks x slot x bytes
    return w, w + x


def main() -> None:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,12288x7168")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    mods: dict = {}

    def _bg(contiguous: bool):
        try:
            mods[contiguous] = build_feed(contiguous)
        except Exception as e:  # noqa: BLE001 - reported below
            mods[contiguous] = e

    threads = [threading.Thread(target=_bg, args=(c,)) for c in (False, True)]
    for t in threads:
        t.start()
    ok = sm90.available()
    for t in threads:
        t.join()
    if not ok or any(isinstance(m, Exception) for m in mods.values()):
        raise SystemExit(f"sm90_feed: GEMM available {ok} ({sm90._error}); feed builds: {mods}")
    gemm = sm90._module
    # (column, module, producer form): the GEMM twice around the feed-only launches (its pass-to-pass spread)
    runs = (
        ("gemm", gemm, None),
        ("feed", mods[False], "tensor"),
        ("feed_warp", mods[False], "warp"),
        ("feed_warp_contig", mods[True], "warp"),
        ("gemm2", gemm, None),
    )
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    print(
        "| N x K | M | config | GEMM us (two passes) | feed-only: tensor / warp / warp chunk-major us "
        "| feed / GEMM | DRAM TB/s: GEMM / feed / warp / chunk-major | L2->SM TB/s (GEMM / feed) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = copies_for(n * k * BYTES_PER_NVFP4_WEIGHT)
        _, _, ws = _weights(n, k, copies)
        for m, cfg in CASES:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            if not sm90.config_ok(*cfg, -(-k // 128)):
                continue
            times = {}
            for name, mod, form in runs:
                fns = [
                    lambda w=w: sm90.nvfp4_sm90_gemm(
                        x, w.weight, w.scale_bits, w.global_scale, k, n, config=cfg, producer=form
                    )
                    for w in ws
                ]
                sm90._module = mod
                try:
                    times[name] = graph_ms(fns, 0.05) * 1e3
                finally:
                    sm90._module = gemm
            g, f = min(times["gemm"], times["gemm2"]), times["feed"]
            fw, fc = times["feed_warp"], times["feed_warp_contig"]
            dram, l2 = ring_bytes(m, n, k, cfg)
            rows.append({"shape": shape, "m": m, "cfg": cfg, **times})
            tbs = " / ".join(f"{dram / t / 1e6:.2f}" for t in (g, f, fw, fc))
            print(
                f"| {shape} | {m} | {cfg} | {times['gemm']:.1f} / {times['gemm2']:.1f} "
                f"| {f:.1f} / {fw:.1f} / {fc:.1f} | {f / g:.2f} | {tbs} "
                f"| {l2 / g / 1e6:.2f} / {l2 / f / 1e6:.2f} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
