"""Compiled CPU loops for the quantized linears (kernels/nvfp4_gemm/cpu.py, kernels/fp8_gemm/cpu.py).

The CPU references dequantize a whole weight to fp32 and then multiply, which writes and reads ~8 bytes of
temporaries per weight: at decode that is tens of times slower than the matmul itself. The fused forms
decode inside the dot products; torch.compile (Inductor's C++ backend, vectorised) turns each into one loop
that reads every quantized byte once. This module holds what they share:
- when they apply: at most MAX_M rows for the fused GEMVs (each row decodes the weight again; above that a
  compiled dequantization in row blocks + matmul), on matrices of at least MIN_WEIGHTS weights (below that
  the reference's temporaries stay in cache and a compiled call's fixed cost dominates);
- one compile per function for every shape (dynamic shapes, parameters passed as plain tensors), so a
  model's many layer shapes do not each compile; the few variants the guards still tell apart stay under a
  raised recompile limit (past it torch.compile would run these loops eagerly); callers pass every scale at
  its full size (never a broadcast [1]), which would be one more variant;
- the fallback: if Inductor cannot build (no C++ compiler, say), the reference runs from then on and the
  reason is logged once (`disabled`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MAX_M = 8
MIN_WEIGHTS = 1 << 20
DEQUANT_BLOCK_FLOATS = 1 << 21  # fp32 elements per dequantized row block (~8 MB) above MAX_M rows
RECOMPILE_LIMIT = 64

disabled: str | None = None
_compiled: dict[Callable, Callable] = {}


def applies(n: int, k: int) -> bool:
    """Whether an [N, K] weight takes a compiled path."""
    return disabled is None and n * k >= MIN_WEIGHTS


def block_rows(k: int, align: int) -> int:
    """Rows per dequantized block: ~DEQUANT_BLOCK_FLOATS elements, a multiple of `align` (>= align)."""
    return max(align, DEQUANT_BLOCK_FLOATS // k // align * align)


def run(fn: Callable, *args) -> torch.Tensor | None:
    """fn(*args) compiled (once per function); None if compiling fails (then for good: the caller runs its
    reference)."""
    global disabled
    if disabled is not None:
        return None
    # parameters as plain tensors: torch.compile keeps an nn.Parameter's shape static even with dynamic=True,
    # so every weight shape would compile again, and past its recompile limit (8) the loop would run eagerly
    args = tuple(a.detach() if isinstance(a, torch.nn.Parameter) else a for a in args)
    try:
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=True)
        # one grad mode for every caller (it is part of the compiled code's guards); a higher recompile limit
        # for the few variants guards still tell apart (one row or several, a sliced weight's storage
        # offset, inference-mode tensors or not): past the limit torch.compile would run the loops eagerly
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return _compiled[fn](*args)
    except Exception as e:  # no compiler, an Inductor limitation: the references from now on
        disabled = f"{type(e).__name__}: {e}"
        log.warning("the fused CPU kernels could not be compiled; using the references: %s", disabled)
        return None


def dequantized_matmul(
    x: torch.Tensor, n: int, rows: int, fn: Callable, block: Callable[[int, int], tuple]
) -> torch.Tensor | None:
    """x [M, K] fp32 @ W^T for M above MAX_M: W's rows [i, i + rows) decoded by the compiled fn(*block(i,
    i + rows)) into fp32 (~DEQUANT_BLOCK_FLOATS at a time, so the memory is reused instead of faulted in for
    a whole-matrix temporary), each multiplied at once; None if compiling fails."""
    parts = []
    for i in range(0, n, rows):
        w = run(fn, *block(i, i + rows))
        if w is None:
            return None
        parts.append(x @ w.t())
    return torch.cat(parts, dim=1)


def finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 y (+ bias in fp32), in the caller's dtype: the references' epilogue."""
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype)
