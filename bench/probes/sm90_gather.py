"""Where the CUDA C++ NVFP4 GEMM's x gather (K3RUN_SM90_X_GATHER; gather_x in w4a16_sm90.cu) loses its time:
the GEMM built again with one part of the gather changed, each timed with the gather on beside the shipped
build's gather on and off (prep_x + the GEMM), same weights, configs and launches.

Why (bench/NOTES.md, session 45): four gathers permuting x in the producer, each bit-equal to prep_x's
path, ran 1.3-2x slower than prep_x + the GEMM at 16-32 rows, where removing prep_x's launch should have
saved ~2.5 us of ~21; the one shipped has the consumers permute each slot.
Variants (timing only: some lay x out wrong or race, so their outputs are not checked):
- nofence: no fence.proxy.async after the consumers' permute stores;
- nopermute: no permute at all (the slot's x as the copies bring it), so no stores, fence or barrier work;
- nosync: no named barrier between the permute and the wgmma.

    PYTHONPATH=src python3 bench/probes/sm90_gather.py [--shapes 7168x7168,12288x7168] [--out FILE]
"""

# ruff: noqa: B023

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wgmma import _weights  # noqa: E402
from common import BYTES_PER_NVFP4_WEIGHT, copies_for, graph_ms  # noqa: E402
from sm90_feed import _using, variant_args  # noqa: E402

FENCE = "    fence_proxy_async_smem();\n  }\n}\n"  # permute_x's last lines
PERMUTE = "  if (GATHER && r.gather) permute_x<BT>(r.x0 + st * SM::X);\n"
SYNC = "  if (GATHER && r.gather) consumer_sync(128);"
VARIANTS = {
    "nofence": ((FENCE, "  }\n}\n"),),
    "nopermute": ((PERMUTE, ""),),
    "nosync": ((SYNC, "  if (false) consumer_sync(128);"),),
}
CASES = ((16, (16, 1, 2, 8)), (32, (32, 1, 2, 8)), (32, (32, 1, 2, 5)))


def variant_source(variant: str) -> str:
    """The GEMM's source with VARIANTS[variant]'s replacements (each must still find its line)."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    src = sm90.cuda_source()
    for old, new in VARIANTS[variant]:
        if old not in src:
            raise RuntimeError(f"sm90_gather: {variant}: {old!r} is gone from the .cu")
        src = src.replace(old, new)
    return src


def main() -> None:
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    args, mods = variant_args("k3run_sm90_gather_", VARIANTS, variant_source)
    gemm = sm90._module
    runs = [("off", gemm, False), ("on", gemm, True)] + [(v, mods[v], True) for v in VARIANTS]
    runs.append(("off2", gemm, False))
    print(torch.cuda.get_device_name())
    print("| N x K | M | config | " + " | ".join(name for name, _, _ in runs) + " | on / off |")
    print("|---|---|---|" + "---|" * (len(runs) + 1))
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        _, _, ws = _weights(n, k, copies_for(n * k * BYTES_PER_NVFP4_WEIGHT))
        for m, cfg in CASES:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            times = {}
            for name, mod, gather in runs:
                fns = [
                    lambda w=w: sm90.nvfp4_sm90_gemm(
                        x, w.weight, w.scale_bits, w.global_scale, k, n, config=cfg, gather=gather
                    )
                    for w in ws
                ]
                with _using(mod):
                    graph_ms(fns, 0.05)  # a shape's first timing can run slow: discarded
                    times[name] = graph_ms(fns, 0.05) * 1e3
            off = min(times["off"], times["off2"])
            rows.append({"shape": shape, "m": m, "cfg": cfg, **times})
            cells = " | ".join(f"{times[name]:.1f}" for name, _, _ in runs)
            print(f"| {shape} | {m} | {cfg} | {cells} | {times['on'] / off:.2f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
