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
