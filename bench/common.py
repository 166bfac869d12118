"""What every bench script shares: one way to time GPU work (back-to-back calls captured in a CUDA graph,
rotating over copies that overflow the L2: `graph_ms`) and one copy-bandwidth ceiling. `eager_ms` only for
what a graph cannot hold (torch references and fla calls that read values back to the host) and for
questions about the host's share of a call.

    from common import copies_for, copy_bandwidth, eager_ms, graph_ms   (bench/ on sys.path)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

BYTES_PER_NVFP4_WEIGHT = 0.5 + 1 / 16  # packed nibble + one E4M3 scale per 16
L2_BYTES = 50 * 2**20  # an H100 / H200's L2 (H200: 60 MB; 50 MB keeps the rotation sizes of earlier runs)


def copies_for(nbytes: float) -> int:
    """Weight copies to rotate over so that one pass touches >= 3x the L2."""
    return max(2, min(32, int(3 * L2_BYTES / max(nbytes, 1)) + 1))


def graph_ms(fns: list[Callable[[], object]], est_ms: float | None = None) -> float:
    """Median time per call of the round-robin over fns, captured as one CUDA graph; est_ms (a call's
    expected time, which sets how many rounds the graph holds) is measured on one eager round when None."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    if est_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for f in fns:
            f()
        end.record()
        end.synchronize()
        est_ms = start.elapsed_time(end) / len(fns)
    reps = max(1, min(64, int(4.0 / max(est_ms * len(fns), 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second, in TB/s."""
    a = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    b = torch.empty_like(a)
    # do_bench, not a graph: a captured device copy may run on a copy engine instead of the SMs
    t = eager_ms(lambda: b.copy_(a), rep=200)
    return 2 * 2**30 * 2 / t / 1e9


def eager_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of eager back-to-back calls (triton's do_bench: the L2 flushed before each), host work
    included: for calls a graph cannot capture. `rep` is do_bench's time budget in ms."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


class SmiSampler:
    """The GPU's SM clock (MHz), power (W) and active clock-event reasons, sampled by `nvidia-smi -lms` every
    `ms` in a thread, each sample stamped with time.monotonic() as it arrives: `window(t0, t1)` gives their
    medians between two stamps (a sustained phase of a benchmark), or None without samples (no nvidia-smi).
    Read-only: it queries the GPU and changes none of its settings."""

    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __init__(self, ms: int = 20, device: int = 0) -> None:
        import shutil
        import subprocess
        import threading

        self.samples: list[tuple[float, float, float, float, str]] = []
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        cmd = ["nvidia-smi", "-i", str(device), f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits"]
        self.proc = subprocess.Popen(cmd + [f"-lms={ms}"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        import time

        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                clk, pw, temp = float(parts[0]), float(parts[1]), float(parts[2])
            except (ValueError, IndexError):
                continue
            self.samples.append((time.monotonic(), clk, pw, temp, parts[3] if len(parts) > 3 else ""))

    def window(self, t0: float, t1: float) -> dict[str, object] | None:
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return None
        reasons = sorted({s[4] for s in got})
        return {
            "mhz": statistics.median(s[1] for s in got),
            "watts": statistics.median(s[2] for s in got),
            "temp_c": max(s[3] for s in got),
            "reasons": reasons,
            "n": len(got),
        }

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


def rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of fns in turn per call (the copies that overflow the L2), for `sustain`."""
    import itertools

    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def held_text(stats: dict[str, object] | None) -> str:
    """A sampler window as 'MHz / W' for a table cell ('-' without samples)."""
    return "-" if stats is None else f"{stats['mhz']:.0f} / {stats['watts']:.0f}"


def sustain(fn: Callable[[], object], seconds: float, sampler: SmiSampler, settle: float = 0.4):
    """Runs fn back to back (captured as a graph of enough calls for ~20 ms a replay) for `seconds`, and
    returns (us per call over the whole phase, the sampler's window after the first `settle` seconds): the
    clock and power a kernel holds once the GPU's power management has reacted to it."""
    import time

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(2000, int(20.0 / max(start.elapsed_time(end), 1e-3))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    start.record()
    replays = 0
    while time.monotonic() - t0 < seconds:
        graph.replay()
        replays += 1
        if replays % 4 == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    t1 = time.monotonic()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * reps), sampler.window(t0 + settle, t1)
