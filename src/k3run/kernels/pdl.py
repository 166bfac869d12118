"""Programmatic dependent launch (PDL, sm_90+) for the decode step's small Triton kernels.

A kernel launched with PDL may be scheduled before the previous kernel on its stream has finished, once that
kernel's programs have all signalled (`griddepcontrol.launch_dependents`) or exited. The NVFP4 GEMVs already
work this way: they stage their first weight tiles, then wait. The step's other kernels (norms, the router,
the gated activation, the top-k combine, KDA's conv, the expert grouping, MLA's decode attention and its
merge) are short; between two of them, or before a GEMV, the GPU otherwise idles for a launch's latency.

`pdl_enter(PDL)` at the top of such a kernel: with PDL it first waits for the previous kernel (and its
writes) to be complete, then lets the next kernel launch at once. Nothing is read or written before the
wait, so the kernel sees exactly what it would without PDL; what overlaps is only the next kernel's launch
and, for a GEMV, its weight prefetch. `launch_pdl(t)` says whether to launch with it: on sm_90+ unless
K3RUN_PDL_ALL=0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from k3run.knobs import knobs


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        tl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_pdl(t: torch.Tensor) -> bool:
    """Whether a small kernel on t's device launches with PDL (its `PDL` constexpr and `launch_pdl`)."""
    return t.is_cuda and knobs().pdl_all and _sm90(t.device.index or 0)


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel taking a `PDL` constexpr: PDL on or off for t's device, and
    `launch_pdl` where on (the interpreter's launcher takes no such argument)."""
    return {"PDL": True, "launch_pdl": True} if launch_pdl(t) else {"PDL": False}
