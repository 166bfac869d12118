"""`make run`'s decode on the CPU, idle and beside one busy core, with the threads k3run chooses (auto) and
with every core (torch's default), interleaved run by run in one process tree.

    python bench/bench_cpu_threads.py [--repeats 3] [--model DIR]

The busy core is a child process spinning in pure Python (bounded: it is killed after each timed run and
exits by itself after 10 minutes). Prints decode tok/s per setting (best and median of the repeats) and the
ratio auto / every core.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "import time\nt = time.time() + 600\nwhile time.time() < t:\n    pass\n"


def decode_rate(threads: str | None, model: str | None) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("OMP_NUM_THREADS", None)
    env.pop("K3RUN_CPU_THREADS", None)
    if threads is not None:
        env["K3RUN_CPU_THREADS"] = threads
    cmd = [sys.executable, "-m", "k3run.cli", "--quiet", "generate"]
    cmd += [model] if model else []
    cmd += ["--prompt", "def parse(", "--max-tokens", "128", "--ignore-eos"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    m = re.search(r"decode ([0-9.]+) tokens/s", out.stderr)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"generate failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    settings = [("auto", None), (f"every core ({cores})", str(cores))]
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for load in ("idle", "one busy core"):
            for name, threads in settings:
                spin = subprocess.Popen([sys.executable, "-c", SPIN]) if load != "idle" else None
                try:
                    rates.setdefault((load, name), []).append(decode_rate(threads, args.model))
                finally:
                    if spin is not None:
                        spin.kill()
                        spin.wait()
    print(f"{'machine':<15} {'threads':<18} {'best tok/s':>10} {'median':>8}   (repeats {args.repeats})")
    for load in ("idle", "one busy core"):
        for name, _ in settings:
            r = rates[(load, name)]
            print(f"{load:<15} {name:<18} {max(r):>10.1f} {statistics.median(r):>8.1f}")
        a, b = (statistics.median(rates[(load, n)]) for n, _ in settings)
        print(f"{load:<15} {'auto / every core':<18} {a / b:>10.2f}x")


if __name__ == "__main__":
    main()
