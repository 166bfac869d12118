"""Question: where do the reduced K3's CUDA logits leave the CPU's fp32 ones, by token count, and is one of
the MoE launches (grouped per pick, expert-major, per-expert loop) at fault?

Answer (bench/RESULTS.md "Runs 78-81", run 80): no launch is. All three give identical errors at every token
count (MXFP4 0.9-11%, NVFP4 3.7-32%), tracking the CPU's own bf16 errors (0.8-13% / 2.6-24%): a random
model's bf16 router flips, not a kernel fault; the tests compare layer outputs on fixed routing instead.

Both published layouts (tests/k3_published.py); prints one table:

    python bench/probes/small_moe_gpu.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3run.api import load_model  # noqa: E402
from k3run.knobs import reset_knobs  # noqa: E402
from k3run.layers.moe import FusedExperts  # noqa: E402
from k3run.testing import rel_rms_error  # noqa: E402
from tests import k3_published  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mxfp4", "nvfp4"):
            d = k3_published.write(Path(tmp) / kind, kind)
            cpu32 = load_model(d, dtype=torch.float32)
            cpu16 = load_model(d, dtype=torch.bfloat16)
            gpu = load_model(d, dtype=torch.bfloat16, device="cuda")
            exps = [m for m in gpu.modules() if isinstance(m, FusedExperts)]
            scheme = exps[0].scheme
            print(kind, "experts:", exps[0].algo, "kernels", scheme.kernels, "tiled", scheme.tiled)
            for t in (1, 2, 5, 7, 8, 9, 16, 17, 37, 150):
                ids = torch.randint(1, 500, (t,), generator=torch.Generator().manual_seed(t))
                ref = cpu32.logits(ids)
                row = [f"T={t:<4}", f"cpu bf16 {rel_rms_error(ref, cpu16.logits(ids).float()):.2e}"]
                for mode in ("default", "by_expert=0", "loop"):
                    os.environ["K3RUN_MOE_BY_EXPERT"] = "0" if mode == "by_expert=0" else "1"
                    reset_knobs()
                    saved = [e.grouped_ok for e in exps]
                    if mode == "loop":
                        for e in exps:
                            e.grouped_ok = lambda *a: False
                    out = gpu.logits(ids.cuda()).float().cpu()
                    for e, g in zip(exps, saved):
                        e.grouped_ok = g
                    row.append(f"{mode} {rel_rms_error(ref, out):.2e}")
                print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
