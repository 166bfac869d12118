"""Numerical comparison helpers shared by the tests and the benchmarks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def rel_rms_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref||_2 / ||ref||_2 computed in fp64 (0 when both are all zero)."""
    ref64 = ref.detach().to(torch.float64)
    out64 = out.detach().to(torch.float64)
    num = torch.linalg.vector_norm(out64 - ref64).item()
    den = torch.linalg.vector_norm(ref64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float, atol: float = 0.0) -> None:
    """Compare `out` with the fp32/fp64 reference `ref`.

    Passes when the NaN/Inf positions (and signs of Inf) agree exactly and either every element is within
    `atol`, or the relative RMS error over the finite elements is below `rtol`. The caller states why the
    tolerance fits the dtype (e.g. bf16 has 8 mantissa bits: one rounding is <= 2^-9 relative).
    """
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    ref32 = ref.detach().float().cpu()
    out32 = out.detach().float().cpu()
    nan_r, nan_o = torch.isnan(ref32), torch.isnan(out32)
    if not torch.equal(nan_r, nan_o):
        bad = (nan_r != nan_o).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: NaN positions differ (first at {bad}); an unwritten output is NaN")
    inf_r, inf_o = torch.isinf(ref32), torch.isinf(out32)
    if not torch.equal(inf_r, inf_o) or not torch.equal(ref32[inf_r], out32[inf_o]):
        raise AssertionError(f"{name}: Inf positions or signs differ")
    finite = torch.isfinite(ref32)
    r, o = ref32[finite], out32[finite]
    if r.numel() == 0:
        return
    max_abs = (o - r).abs().max().item()
    if max_abs <= atol:
        return
    err = rel_rms_error(r, o)
    if not err < rtol:
        raise AssertionError(
            f"{name}: relative RMS error {err:.3e} >= {rtol:.1e} (max abs diff {max_abs:.3e})"
        )


@contextlib.contextmanager
def nan_poisoned_empty() -> Iterator[None]:
    """Make torch.empty / empty_like return NaN-filled floats so an unwritten output fails a comparison."""
    orig_empty, orig_like = torch.empty, torch.empty_like

    def _poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xFF)
        return t

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _poison(orig_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _poison(orig_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = orig_empty, orig_like
