from __future__ import annotations

import pytest
import torch

from k3run.testing import assert_close, nan_poisoned_empty, rel_rms_error


def test_assert_close_catches_nan_and_error() -> None:
    ref = torch.randn(37, 11)
    assert_close("same", ref, ref.clone(), rtol=1e-7)
    bad = ref.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(AssertionError, match="NaN positions"):
        assert_close("nan", ref, bad, rtol=1.0)
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close("noisy", ref, ref + 0.1 * torch.randn_like(ref), rtol=1e-3)
    # a bf16 rounding is <= 2^-9 relative per element, so the RMS error is below 2^-9
    assert_close("bf16", ref, ref.bfloat16(), rtol=2.0**-9)
    assert rel_rms_error(ref, ref) == 0.0


def test_nan_poisoned_empty() -> None:
    with nan_poisoned_empty():
        assert torch.isnan(torch.empty(5, 3)).all()
        assert (torch.empty(4, dtype=torch.uint8) == 0xFF).all()
    assert not torch.isnan(torch.zeros(2)).any()
