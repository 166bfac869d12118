"""Is racecheck's report on the CUDA C++ NVFP4 GEMM's ring (bench/NOTES.md, session 46) about the protocol or
about what racecheck follows? The GEMM built again with every consumer lane arriving on a slot's "empty"
barrier (its count 32x) in place of `__syncwarp` and lane 0's arrive, then the reused-slot cases of
bench/probes/sm90_sanity.py run on that build and checked against the fp32 reference the same way:

    compute-sanitizer --tool racecheck python3 bench/probes/sm90_release.py

Reading: if racecheck reports nothing here and reports the shipped build's same cases (`sm90_sanity.py
--pick 14,15,18`), it does not follow lane 0's arrive back through `__syncwarp` to the other lanes' loads,
and the shipped protocol stands; if it reports these too, the ring's release needs a closer look.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sm90_feed import _using, build_variants  # noqa: E402
from sm90_sanity import run_case  # noqa: E402

RELEASE = "    if (r.lane == 0) mbar_arrive(r.empty + 8 * (ONE ? st : st == 0 ? r.stages - 1 : st - 1));\n"
EVERY = "    mbar_arrive(r.empty + 8 * (ONE ? st : st == 0 ? r.stages - 1 : st - 1));\n"
COUNT = "mbar_init(&empty[i], NWG * 4);"
# (m, n, k, config, producer, x gather): 16 chunks through a ring of two slots, every slot reused
CASES = (
    (17, 200, 2048, (32, 1, 1, 2), "thread", False),
    (17, 200, 2048, (32, 1, 1, 2), "warp", False),
    (17, 200, 2048, (32, 1, 1, 2), "warp", True),
)


def variant_source(_: str = "everylane") -> str:
    """The GEMM's source with every consumer lane arriving on the slot it frees."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    src = sm90.cuda_source()
    for old in (RELEASE, COUNT):
        if old not in src:
            raise RuntimeError(f"sm90_release: {old!r} is gone from the .cu")
    return src.replace(RELEASE, EVERY).replace(COUNT, "mbar_init(&empty[i], NWG * 128);")


def main() -> int:
    mods = build_variants("k3run_sm90_release_", ["everylane"], variant_source)
    bad = 0
    for m, n, k, cfg, producer, gather in CASES:
        with _using(mods["everylane"]):
            ok, line = run_case(m, n, k, cfg, producer, gather)
        bad += not ok
        print(f"{line} (every lane releasing)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
