"""Run a bench script with one engine constant patched, for a same-machine A/B of a threshold.

    PYTHONPATH=src:. python bench/probes/patched_constant.py MODULE:NAME=INT SCRIPT [ARGS ...]

Used for bench/RESULTS.md runs 119-121: `k3run.quant.experts:TILE_FROM_TOKENS=17` (the wgmma GEMMs for every
decode batch from 17 tokens: 0.72x at the full-depth Kimi Linear's batch 32) and
`k3run.quant.experts:TILES_FROM_PICKS_PER_EXPERT=1048576` (the expert-major GEMVs only: the baseline of the
K3-shaped slice's 1.10x / 1.13x at batch 64 / 128).
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3 or ":" not in sys.argv[1] or "=" not in sys.argv[1]:
        raise SystemExit(__doc__)
    module, assignment = sys.argv[1].split(":", 1)
    name, value = assignment.split("=", 1)
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"{module} has no {name}")
    setattr(mod, name, int(value))
    print(f"patched {module}.{name} = {value}", flush=True)
    script = sys.argv[2]
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
