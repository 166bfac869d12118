"""A layer's independent branch on a second CUDA stream: the shared experts beside the router and the routed
experts, KDA's low-rank output gate beside its conv and recurrence, MLA's query beside its latent KV.

Why: at decode sizes a step is a chain of short launches, each with a fixed cost of a few microseconds
(ramp-up, split-K reduction, drain) during which most of the GPU idles. A branch that does not depend on
the chain runs beside it, in eager steps and in the CUDA graphs (a captured fork and join). The branch runs
the same kernels on the same inputs as inline, so the results are the same bits.

Memory: the branch's tensors are allocated on the side stream and read on the current one only after
`result()` made it wait, and its inputs stay referenced by the caller until then; the next fork waits for
everything queued on the current stream, so a block the side stream frees is reused only after its
readers. The caller must call `result()` before it returns (a graph capture must join every fork).

K3RUN_SIDE_STREAM=0 runs every branch inline (for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from k3run.kernels.streams import side_stream
from k3run.knobs import knobs

T = TypeVar("T")


def side_stream_applies(x: torch.Tensor) -> bool:
    """Whether a branch on x [T, ...] runs on the side stream: CUDA, eager or graph capture (not inside
    torch.compile), at most K3RUN_SIDE_MAX_TOKENS rows, not switched off. Why 32 by default: on an H200,
    full-depth Kimi Linear with its own routing (bench/RESULTS.md), the branches took 0.42 ms off a 2.53 ms
    step at batch 1 and 0.44 ms off 3.99 ms at batch 8; on an H100 (bench/RESULTS.md) a bound of 32 against
    16 made the batch-32 step 4.9% faster (10.12 -> 9.64 ms) and the K3-shaped slice's 2.1% faster, batch 8
    and 16 unchanged. Above 32 rows the branches have not been measured beside the chain."""
    return (
        x.is_cuda
        and x.shape[0] <= knobs().side_max_tokens
        and not torch.compiler.is_compiling()
        and knobs().side_stream
    )


class Branch(Generic[T]):
    """fn() queued on the device's side stream after everything queued so far on the current stream (or run
    inline where `side_stream_applies(x)` is false or enabled is False); `result()` makes the current stream
    wait for it and returns fn's value."""

    def __init__(self, fn: Callable[[], T], x: torch.Tensor, enabled: bool = True) -> None:
        self._wait: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        if not (enabled and side_stream_applies(x)):
            self._value = fn()
            return
        main = torch.cuda.current_stream(x.device)
        side = side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._value = fn()
        self._wait = (main, side)

    @property
    def on_side_stream(self) -> bool:
        """Whether the branch is still to be joined (it ran on the side stream)."""
        return self._wait is not None

    def result(self) -> T:
        if self._wait is not None:
            main, side = self._wait
            main.wait_stream(side)
            self._wait = None
        return self._value
