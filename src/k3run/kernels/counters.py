"""The arrival counters of the GPU kernels whose last program to finish does a final reduction: split-K in
the NVFP4 kernels (the decode GEMV, the grouped expert launches, the wgmma and sm_90 CUDA GEMMs) and the
one-launch router (moe_ops).

A program adds 1 to its output block's int32 counter after storing its partial results; the one that
arrives last combines them and puts the counter back to 0. So a counter buffer is all zeros between
launches, and launches need no memset of their own. One buffer per (device, stream): launches on one stream
run in order, so two of them never hold a counter at the same time.

CUDA graphs keep the address of the buffer a captured launch used, which adds two rules:
- A buffer is never freed. A larger need makes a new buffer (at least twice the old size, so there are few)
  and the old one stays referenced here. Freed, its memory would go back to the graph pool, a later
  capture's temporaries would take it, and the graphs captured with the old buffer would read their
  writes as counters: split-K sums finished by the wrong program, silently wrong outputs.
- A buffer made during a capture is zeroed by a memset that runs only when that graph replays, while
  other graphs captured later may use the buffer before it ever does. `zero_counters()` zeros every buffer
  at once; the engine calls it after each capture (`engine.runner.warm_and_capture`).
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 1 << 14  # the first buffer's size: 64 KB, enough for most launches of a decode step


class SplitKCounters:
    """Counter buffers by (device, stream key): `get(device, key, n)` returns a zeroed int32 buffer of at
    least n counters; `zero_all()` zeros every buffer ever returned (none is ever dropped)."""

    def __init__(self, min_size: int = MIN_COUNTERS) -> None:
        self.min_size = min_size
        self.current: dict[tuple[torch.device, int], torch.Tensor] = {}
        self.every: list[torch.Tensor] = []

    def get(self, device: torch.device, key: int, n: int) -> torch.Tensor:
        buf = self.current.get((device, key))
        if buf is None or buf.numel() < n:
            size = max(n, self.min_size, 0 if buf is None else 2 * buf.numel())
            buf = torch.zeros(size, dtype=torch.int32, device=device)
            self.current[(device, key)] = buf
            self.every.append(buf)  # graphs captured with the smaller one still use it
        return buf

    def zero_all(self) -> None:
        for buf in self.every:
            buf.zero_()


_COUNTERS = SplitKCounters()


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 arrival counters on `device` for a launch on its current stream (one buffer
    for a CPU device: the Triton interpreter runs the programs one by one)."""
    key = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _COUNTERS.get(device, key, n)


def zero_counters() -> None:
    """Zero every counter buffer (outside a capture: after one, so that no graph replays counters that only
    another graph's memset would have zeroed)."""
    cuda = torch.cuda.is_available() and any(b.is_cuda for b in _COUNTERS.every)
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("zero_counters: called during a CUDA graph capture")
    if cuda:  # no launch on any stream may hold a counter while it is zeroed, and none may start before it is
        torch.cuda.synchronize()
    _COUNTERS.zero_all()
    if cuda:
        torch.cuda.synchronize()
