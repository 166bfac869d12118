"""Inverse-CDF sampling of a batch's sampled rows: three Triton launches on CUDA, the torch reference
elsewhere.

`sample_inverse_cdf(logits, spec, out, scaled=False)`: for each row of spec [B', 5] float64 (row index,
temperature, top_k, top_p, uniform u), the first token whose inclusive float64 cumulative weight exceeds u
times the row's total, the weights exp(s - max(s)) in fp32 of s = logits[row] / temperature (or of rows
already scaled and top-k / top-p masked, `scaled`), written to out[row].

Why kernels: torch's version is ~15 small launches a step (row gather, division, max, exp, float64 cast,
padded chunked scans, searchsorted, scatter) over a 163840-token vocabulary. The kernels read the logits
three times and write a token. Their float64 sums run in another order than torch's
scans, so a token can differ only where u falls within float64 rounding of a boundary (the tests compare
tokens).
"""

from __future__ import annotations

import logging

import torch

from .ref import chunked_cdf, sample_inverse_cdf_ref

_TRITON_OK = True


def sample_inverse_cdf(
    logits: torch.Tensor, spec: torch.Tensor, out: torch.Tensor, scaled: bool = False
) -> torch.Tensor:
    """The Triton kernels on CUDA (fp32 logits, unit column stride); the reference elsewhere, and from the
    first time Triton cannot build them (a warning names the error)."""
    global _TRITON_OK
    if _TRITON_OK and logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1:
        from k3run.kernels.build_errors import BUILD_ERRORS, triton_build_failed

        from .triton import sample_inverse_cdf_triton

        try:
            return sample_inverse_cdf_triton(logits, spec, out, scaled)
        except BUILD_ERRORS as e:
            if not triton_build_failed(e):
                raise
            log = logging.getLogger(__name__)
            log.warning("sampling: Triton cannot build the kernels, the torch reference runs: %s", e)
            _TRITON_OK = False
    return sample_inverse_cdf_ref(logits, spec, out, scaled)


__all__ = ["chunked_cdf", "sample_inverse_cdf", "sample_inverse_cdf_ref"]
