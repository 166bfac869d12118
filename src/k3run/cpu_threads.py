"""How many intra-op threads a CPU model runs with, chosen by its work.

torch parallelises an op over its OpenMP threads and every thread waits at the op's end for the slowest.
A matrix under `kernels.cpu_fused.MIN_WEIGHTS` (1M) weights is a few microseconds of work per token: a second
thread saves at most that, and when another process holds a core it costs a scheduler time slice per op
(the bundled model on 2 cores with one busy: 5.5 tok/s with 2 threads against 107 with one, bench/NOTES.md).
So a model whose largest matrix is under that size runs on one thread; a larger one keeps torch's default
(every core: the large-matrix kernels are bandwidth-bound and 2 threads read ~2x the bytes of one).

Overrides, first that is set wins: the `threads` argument (the CLI's `--threads`), `$K3RUN_CPU_THREADS`,
`$OMP_NUM_THREADS` (then torch's own setting is kept as it is).
"""

from __future__ import annotations

import os

import torch

from k3run.kernels.cpu_fused import MIN_WEIGHTS
from k3run.knobs import knobs


def largest_matrix(model: torch.nn.Module) -> tuple[str, int]:
    """(name, logical weights) of the model's largest matrix, expert banks counted per expert, the
    embedding and the head left out (a row gather; the head is one matmul per step, not one per layer)."""
    best = ("", 0)
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "lm_head" in name:
            continue
        rows, cols = p.shape[-2], p.shape[-1]
        n = rows * cols * (2 if p.dtype == torch.uint8 else 1)  # NVFP4: two codes per byte
        if n > best[1]:
            best = (name, n)
    return best


def choose_cpu_threads(model: torch.nn.Module, threads: int | None = None) -> tuple[int, str]:
    """The intra-op thread count for `model` on the CPU and the reason, in one line for the log."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads: expected a positive integer, got {threads}")
        return threads, "--threads"
    n = knobs().cpu_threads
    if n is not None:
        return n, "$K3RUN_CPU_THREADS"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "$OMP_NUM_THREADS"
    name, n = largest_matrix(model)
    if n < MIN_WEIGHTS:
        return 1, f"largest matrix {name} has {n:,} weights < {MIN_WEIGHTS:,}: a second thread only waits"
    return torch.get_num_threads(), f"largest matrix {name} has {n:,} weights: every core"


def set_cpu_threads(model: torch.nn.Module, threads: int | None = None) -> str:
    """Apply choose_cpu_threads; returns the log line."""
    n, why = choose_cpu_threads(model, threads)
    torch.set_num_threads(n)
    plural = "s" if n > 1 else ""
    return f"CPU: {n} intra-op thread{plural} ({why}; --threads N or K3RUN_CPU_THREADS=N override)"
