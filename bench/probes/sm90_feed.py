"""How fast the CUDA C++ NVFP4 GEMM's ring is fed (w4a16_sm90.cu) when its consumers do no work: the GEMM
built a second time with consume()'s decode and wgmma group removed (each chunk still waits for its slot,
reads one word of it and releases the previous slot, as the GEMM does), timed beside the real GEMM on the
same weights, configs and launches.

Why (bench/NOTES.md, session 42): sm90_isolate measured the consumer's chunk from shared memory at 408
cycles (BT 64) and 301-479 (BT 16), while the GEMM spends ~790 and ~1240 cycles a chunk at 64 and 16 rows of
7168^2. Run 171 answered the first question: the feed-only launch takes 0.69-0.91x the GEMM's time at
16-256 rows, at 40-71% of the copy bandwidth. The other builds (VARIANTS) ask why the feed is slow: the
codes and scales alone (no x), the x tiles alone, and the warp producer reading a chunk's row blocks in the
weights' order against one contiguous run (DRAM locality). Run 172 answered those (x, DRAM locality and a
rotated chunk order are not it; the x-only launch alone takes ~half the GEMM's time at 16 rows): the GEMM and
the x-only launch are also timed with plain launches against programmatic dependent launch (K3RUN_SM90_PDL),
which starts a call's weight copies while the call before it finishes.

    PYTHONPATH=src python3 bench/probes/sm90_feed.py [--shapes 7168x7168,12288x7168] [--out FILE]

Prints, per (shape, M, config): us of the GEMM (two passes around the others, PDL as the knob says) and of
it with plain launches and with PDL, of each feed-only launch, the tensor feed's ratio to the GEMM, and the
bytes the ring moves (codes + scales from DRAM; those and every CTA's x tile of every chunk from L2) as TB/s.
Needs an sm_90 GPU and nvcc; builds the four variants (~1 min each) in threads while the GEMM's own builds.
"""

# ruff: noqa: B023

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_wgmma import _weights  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, graph_ms  # noqa: E402

# consume()'s work in w4a16_sm90.cu; the feed-only build replaces it with one shared load of the slot
WORK = "  decode_chunk<BF16>(r.w0 + st * SM::W, r.s0 + st * SM::S, a);\n"
ISSUE = "  issue_chunk<BT, BF16, ONE ? 0 : 1>(r.desc0, uint32_t(st * SM::X), acc, a);\n"
FEED = "  acc[0] += __uint_as_float(lds32(r.w0 + st * SM::W) & 1u);\n"
# The feed-only builds (consume()'s work replaced by FEED in each), by name: source replacements on top
# - contiguous: the warp / thread producers read a chunk's nrb row blocks as one run of nrb KB (the same bytes
#   of the tile, chunk-major), not nrb 1 KB pieces CH KB apart: a DRAM-locality test (the data land in other
#   slots, so only the timing means anything);
# - nox: no x copy (the slot's transaction count lowered to match): the codes and scales alone;
# - xonly: only the x copy: the L2 side alone.
BLOCK = "const size_t blk = size_t(g.rb0 + rb) * CH + c;"
BYTES = "return tensor ? SM::X + SM::W + SM::S : g.bytes; };"
XCOPY = "bulk_g2s_elect(xs0 + st * SM::X, g.xsrc + size_t(c) * SM::X, SM::X, bar);"
WCOPY = "if (tensor) {\n            tensor_g2s_elect(wsm0"
# builds whose consumers stay idle (FEED replaces their work); the others keep the GEMM's work
IDLE = ("feed", "contiguous", "nox", "xonly")
VARIANTS = {
    "feed": (),
    "contiguous": ((BLOCK, "const size_t blk = size_t(g.rb0) * CH + size_t(c) * g.nrb + rb;"),),
    "nox": (
        (BYTES, "return (tensor ? SM::X + SM::W + SM::S : g.bytes) - SM::X; };"),
        (XCOPY, ";"),
    ),
    "xonly": (
        (BYTES, "return uint32_t(SM::X); };"),
        (WCOPY, "if (true) {\n          } else if (false) {\n            tensor_g2s_elect(wsm0"),
    ),
}


def feed_source(variant: str = "feed") -> str:
    """The GEMM's source with VARIANTS[variant]'s replacements, its consumers idle (FEED) in IDLE's builds."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    src = sm90.cuda_source()
    if WORK not in src or ISSUE not in src:
        raise RuntimeError("sm90_feed: consume()'s decode / issue lines moved in the .cu; see WORK, ISSUE")
    if variant in IDLE:
        src = src.replace(WORK, FEED).replace(ISSUE, "")
    for old, new in VARIANTS[variant]:
        if old not in src:
            raise RuntimeError(f"sm90_feed: {variant}: {old!r} is gone from the .cu")
        src = src.replace(old, new)
    return src


def build_variants(prefix: str, names, source) -> dict:
    """Each variant's extension module (`source(name)` built as prefix + name), built in threads while the
    GEMM's own build runs; exits naming what failed."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    mods: dict = {}

    def _bg(variant: str):
        try:
            mods[variant] = sm90._build(f"{prefix}{variant}", source(variant))
        except Exception as e:  # noqa: BLE001 - reported below
            mods[variant] = e

    threads = [threading.Thread(target=_bg, args=(v,)) for v in names]
    for t in threads:
        t.start()
    ok = sm90.available()
    for t in threads:
        t.join()
    if not ok or any(isinstance(m, Exception) for m in mods.values()):
        raise SystemExit(f"{prefix}: GEMM available {ok} ({sm90._error}); variant builds: {mods}")
    return mods


def variant_args(prefix: str, names, source):
    """The variant probes' command line (--shapes, --out) and their builds (`build_variants`):
    (args, modules by name)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="7168x7168,12288x7168")
    ap.add_argument("--out", default="")
    return ap.parse_args(), build_variants(prefix, names, source)


@contextlib.contextmanager
def _using(module):
    """nvfp4_sm90_gemm launches `module`'s kernels (a variant build) inside the block, the GEMM's after."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    gemm = sm90._module
    sm90._module = module
    try:
        yield
    finally:
        sm90._module = gemm


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


def ring_bytes(m: int, n: int, k: int, cfg: tuple[int, int, int, int]) -> tuple[float, float]:
    """(DRAM bytes: codes + scales once; L2 -> SM bytes: every CTA's x tile of every chunk + the codes)."""
    bt, nwg = cfg[0], cfg[1]
    w = n * k * BYTES_PER_NVFP4_WEIGHT
    x = -(-n // (64 * nwg)) * -(-m // bt) * -(-k // 128) * 2 * bt * 128  # tiles x chunks x slot x bytes
    return w, w + x


def main() -> None:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    args, mods = variant_args("k3run_sm90_", VARIANTS, feed_source)
    gemm = sm90._module
    # (column, module, producer form, PDL): the GEMM twice around the others (its pass-to-pass spread)
    runs = (
        ("gemm", gemm, None, None),
        ("gemm_plain", gemm, None, False),
        ("gemm_pdl", gemm, None, True),
        ("feed", mods["feed"], "tensor", None),
        ("nox", mods["nox"], "tensor", None),
        ("xonly", mods["xonly"], "tensor", None),
        ("xonly_plain", mods["xonly"], "tensor", False),
        ("feed_warp", mods["feed"], "warp", None),
        ("feed_warp_contig", mods["contiguous"], "warp", None),
        ("gemm2", gemm, None, None),
    )
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    print(
        "| N x K | M | config | GEMM us (two passes) | GEMM plain / PDL us (plain / PDL) | feed-only us: "
        "tensor / no x / x only (plain) / warp / warp chunk-major | feed / GEMM | DRAM TB/s: GEMM / feed / "
        "warp / chunk-major | L2->SM TB/s (GEMM / feed) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
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
            for name, mod, form, pdl in runs:
                fns = [
                    lambda w=w: sm90.nvfp4_sm90_gemm(
                        x, w.weight, w.scale_bits, w.global_scale, k, n, config=cfg, producer=form, pdl=pdl
                    )
                    for w in ws
                ]
                with _using(mod):
                    times[name] = graph_ms(fns, 0.05) * 1e3
            g, f = min(times["gemm"], times["gemm2"]), times["feed"]
            fw, fc = times["feed_warp"], times["feed_warp_contig"]
            gp, gd = times["gemm_plain"], times["gemm_pdl"]
            dram, l2 = ring_bytes(m, n, k, cfg)
            rows.append({"shape": shape, "m": m, "cfg": cfg, **times})
            tbs = " / ".join(f"{dram / t / 1e6:.2f}" for t in (g, f, fw, fc))
            print(
                f"| {shape} | {m} | {cfg} | {times['gemm']:.1f} / {times['gemm2']:.1f} "
                f"| {gp:.1f} / {gd:.1f} ({gp / gd:.2f}x) "
                f"| {f:.1f} / {times['nox']:.1f} / {times['xonly']:.1f} ({times['xonly_plain']:.1f}) "
                f"/ {fw:.1f} / {fc:.1f} | {f / g:.2f} | {tbs} | {l2 / g / 1e6:.2f} / {l2 / f / 1e6:.2f} |",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
