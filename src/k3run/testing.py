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


def _same_nonfinite(name: str, ref: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as fp32 on the CPU, after checking the shapes and that the NaN positions and the Inf positions
    and signs agree exactly (an unwritten, NaN-poisoned output fails here)."""
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
    return ref32, out32


# Relative RMS error bounds for `assert_close`, by the dtype the compared outputs are computed or rounded in
# (tests pass rtol=RTOL[dtype]; a test with another bound states its own and why).
RTOL = {
    # fp32: the same operands in another summation order. A K-term fp32 sum moves by ~K * 2^-24 relative at
    # worst (K <= 512 in the tests: ~3e-5 worst, ~1e-7 measured), its RMS far less; any wrong formula is off
    # by O(1)
    torch.float32: 1e-5,
    # fp16: 11 significant bits, one final rounding moves an output by at most 2^-11 relative; the fp32
    # arithmetic before it adds ~1e-7
    torch.float16: 2.0**-11,
    # bf16: 8 significant bits, one final rounding moves an output by at most 2^-9 relative; 2^-8 leaves room
    # for one more bf16 rounding upstream (a weight or an activation cast), which averages out over K
    torch.bfloat16: 2.0**-8,
}

FP32_U = 2.0**-24  # fp32 unit roundoff: one round-to-nearest moves a value by at most this fraction of it


def output_ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |ref| (fp32 tensor): how far one rounding of an output to `dtype` can flip
    between neighbours when two fp32 values on either side of a midpoint are rounded. 0 for fp32 outputs."""
    if dtype == torch.float32:
        return torch.zeros_like(ref, dtype=torch.float32)
    a = ref.detach().float().abs().to(dtype)
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).float()


def assert_within(name: str, ref: torch.Tensor, out: torch.Tensor, bound: torch.Tensor) -> None:
    """Elementwise |out - ref| <= bound, with assert_close's NaN/Inf rules.

    `bound` is a derived error bound (e.g. counted fp32 roundings times the magnitudes they act on),
    broadcastable to `ref`; the message names the worst element and its ratio to its bound.
    """
    ref32, out32 = _same_nonfinite(name, ref, out)
    finite = torch.isfinite(ref32)
    b = torch.broadcast_to(bound.detach().float().cpu(), ref32.shape)
    diff = torch.where(finite, (out32 - ref32).abs(), torch.zeros_like(ref32))
    over = diff > b
    if over.any():
        ratio = torch.where(b > 0, diff / b, torch.full_like(diff, float("inf")))
        i = int(ratio.flatten().argmax())
        idx = list(torch.unravel_index(torch.tensor(i), ref32.shape))
        raise AssertionError(
            f"{name}: {int(over.sum())} of {ref32.numel()} elements outside their error bound; worst at "
            f"{[int(j) for j in idx]}: |{out32.flatten()[i].item():.6e} - {ref32.flatten()[i].item():.6e}| = "
            f"{diff.flatten()[i].item():.3e} > {b.flatten()[i].item():.3e}"
        )


def noise_floor_rtol(truth: torch.Tensor, low: torch.Tensor, factor: float = 4.0) -> float:
    """A relative-RMS bound for an implementation under test, from a reference's own rounding noise.

    `truth` is a computation in fp64, `low` the same computation run in the precision under test (fp32). The
    implementation under test runs the same operations in another order, so its rounding error against
    `truth` is a sum of the same number of roundings of the same magnitudes: of the reference's size, up to
    how the orders line up. `factor` (default 4) covers that; a wiring slip is orders of magnitude larger.
    The same rule as flash-attention's tests (error <= c x the fp32 reference's error against the fp64 one);
    it holds on any CPU or library version because both errors move together.
    """
    return factor * max(rel_rms_error(truth, low), FP32_U)


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, rtol: float, atol: float = 0.0) -> None:
    """Compare `out` with the fp32/fp64 reference `ref`.

    Passes when the NaN/Inf positions (and signs of Inf) agree exactly and either every element is within
    `atol`, or the relative RMS error over the finite elements is below `rtol`. The caller states why the
    tolerance fits the dtype (e.g. bf16 has 8 mantissa bits: one rounding is <= 2^-9 relative).
    """
    ref32, out32 = _same_nonfinite(name, ref, out)
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
