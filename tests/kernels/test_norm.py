"""Fused RMSNorm (plain and sigmoid-gated) and the K3 AttnRes mix against their fp32 torch references.

Error bounds. The kernels run the references' fp32 operations but sum in another order, so fp32 outputs
agree to a few fp32 roundings: relative RMS error <= 1e-6. 16-bit outputs are rounded once from those fp32
values, so an element can land one output ulp away where the fp32 value sits near a rounding midpoint:
relative RMS error <= one ulp, 2^-8 for bf16 and 2^-11 for fp16 (and in practice far fewer elements flip).

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules. The
interpreter mishandles bf16 math (toolchain notes), so it runs fp32 and fp16 only.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.norm import attn_res_mix_ref, rms_norm_ref
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

RTOL = {torch.float32: 1e-6, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _rows(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    # rows of very different scales, so the per-row normalisation matters
    x = torch.randn(*shape) * torch.logspace(-2, 2, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    return x.to(dtype).to(device)


def _check_rms(dtype: torch.dtype, device: str, shape: tuple[int, ...], gated: bool) -> None:
    from k3run.kernels.norm.triton import rms_norm_triton

    x = _rows(shape, dtype, device)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype).to(device)
    g = torch.randn(shape).to(dtype).to(device) * 3 if gated else None
    out = rms_norm_triton(x, w, 1e-5, g)
    ref = rms_norm_ref(x, w, 1e-5, g)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close("rms_norm", ref.float(), out.float(), RTOL[dtype])


def _check_mix(dtype: torch.dtype, device: str, n: int, t: int, d: int) -> None:
    from k3run.kernels.norm.triton import attn_res_mix_triton

    cands = [_rows((t, d), dtype, device) * (i + 1) for i in range(n)]
    query = torch.randn(d, device=device) / d**0.5 * 8  # peaked softmaxes as well as flat ones
    out = attn_res_mix_triton(cands, query, 1e-5)
    ref = attn_res_mix_ref(cands, query, 1e-5)
    assert out.dtype == dtype and out.shape == (t, d)
    assert_close("attn_res_mix", ref.float(), out.float(), RTOL[dtype])


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=8)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_interp_rms_norm(dtype: torch.dtype, gated: bool) -> None:
    _check_rms(dtype, "cpu", (5, 3, 129), gated)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3])
def test_interp_attn_res_mix(dtype: torch.dtype, n: int) -> None:
    _check_mix(dtype, "cpu", n, 3, 129)


def test_cpu_dispatch_is_the_reference_bit_for_bit() -> None:
    from k3run.kernels.norm import attn_res_mix, rms_norm

    x, g = torch.randn(4, 37).bfloat16(), torch.randn(4, 37).bfloat16()
    w = torch.rand(37).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5, g), rms_norm_ref(x, w, 1e-5, g))
    cands, q = [torch.randn(4, 37).bfloat16() for _ in range(3)], torch.randn(37)
    assert torch.equal(attn_res_mix(cands, q, 1e-5), attn_res_mix_ref(cands, q, 1e-5))


def test_kernel_argument_errors_name_the_mismatch() -> None:
    from k3run.kernels.norm.triton import attn_res_mix_triton, rms_norm_triton

    with pytest.raises(ValueError, match="weight has 5 elements"):
        rms_norm_triton(torch.randn(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(ValueError, match="query has 3 elements"):
        attn_res_mix_triton([torch.randn(2, 4)], torch.ones(3), 1e-5)


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7168), (7, 3584), (9, 96, 128), (3, 4097)])
@pytest.mark.parametrize("gated", [False, True])
@GPU[0]
@GPU[1]
def test_gpu_rms_norm(dtype: torch.dtype, shape: tuple[int, ...], gated: bool) -> None:
    _check_rms(dtype, "cuda", shape, gated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "t", "d"), [(1, 1, 7168), (2, 8, 7168), (9, 5, 4099), (13, 3, 128)])
@GPU[0]
@GPU[1]
def test_gpu_attn_res_mix(dtype: torch.dtype, n: int, t: int, d: int) -> None:
    _check_mix(dtype, "cuda", n, t, d)
