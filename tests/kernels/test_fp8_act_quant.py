"""1x128 FP8 activation quantization: the Triton kernel is bit-exact with the formats reference.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules.
"""

from __future__ import annotations

import pytest
import torch

from k3run.formats import quantize_fp8_act_1x128
from k3run.kernels.fp8_act_quant import fp8_act_quant_ref, quantize_act_1x128
from tests.interpreter_utils import interp_only, run_interp_tests_in_child


def _activations(m: int, k: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows spanning 15 decades (tiny rows exercise E4M3 subnormals), a zero group, signed zeros, outliers."""
    x = torch.randn(m, k, device=device) * torch.logspace(-12, 3, m, device=device)[:, None]
    x[m // 2, 128:256] = 0.0
    x[0, 3] = -0.0
    x[-1, 7] = 1e4
    return x.to(dtype)


def _grid_and_ties() -> torch.Tensor:
    """Rows whose group amax is exactly 448 (scale 1.0), so q = x: every E4M3 value, every midpoint between
    neighbours (ties to even), and points just off the midpoints, with both signs."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    pts = torch.cat([pts, -pts])
    pad = (-pts.numel()) % 127
    pts = torch.cat([pts, torch.full((pad,), 0.3)]).reshape(-1, 127)
    return torch.cat([pts, torch.full((pts.shape[0], 1), 448.0)], dim=1)  # [rows, 128]


def _assert_bit_exact(q, s, x, m_multiple: int = 1) -> None:
    q_ref, s_ref = fp8_act_quant_ref(x, m_multiple)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    mismatch = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} codes differ, first at {mismatch[:3].tolist()}"
    assert torch.equal(s, s_ref)


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=4)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interp_bit_exact(poison_empty, dtype: torch.dtype):
    from k3run.kernels.fp8_act_quant.triton import fp8_act_quant

    x = _activations(7, 3 * 128, dtype)  # 3 groups: the second program's group tile is half empty
    q, s = fp8_act_quant(x, m_multiple=4, scale_outer_major=True, block_m=4, groups_per_program=2)
    assert s.stride() == (1, 8)
    _assert_bit_exact(q, s, x, m_multiple=4)


@interp_only
def test_interp_rounding_grid_and_ties(poison_empty):
    from k3run.kernels.fp8_act_quant.triton import fp8_act_quant

    x = _grid_and_ties()
    q, s = fp8_act_quant(x, block_m=8, groups_per_program=1)
    assert torch.equal(s, torch.ones_like(s))
    _assert_bit_exact(q, s, x)


def test_cpu_dispatch_matches_formats():
    x = _activations(5, 256, torch.bfloat16)
    q, s = quantize_act_1x128(x)
    q_ref, s_ref = quantize_fp8_act_1x128(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    q4, s4 = quantize_act_1x128(x, m_multiple=4, scale_outer_major=True)
    assert q4.shape == (8, 256) and s4.stride() == (1, 8)
    assert torch.equal(q4[:5].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s4[:5], s_ref)
    assert torch.count_nonzero(q4[5:].float()) == 0
    with pytest.raises(ValueError, match="128"):
        quantize_act_1x128(torch.randn(2, 100))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 333])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_bit_exact(poison_empty, m: int, dtype: torch.dtype):
    x = _activations(m, 7 * 128, dtype, device="cuda")
    q, s = quantize_act_1x128(x, m_multiple=4, scale_outer_major=True)
    _assert_bit_exact(q.cpu(), s.cpu(), x.cpu(), m_multiple=4)


@pytest.mark.gpu
def test_gpu_rounding_grid_and_ties(poison_empty):
    x = _grid_and_ties()
    q, s = quantize_act_1x128(x.cuda())
    _assert_bit_exact(q.cpu(), s.cpu(), x)
