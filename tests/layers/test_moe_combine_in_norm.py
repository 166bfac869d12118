"""An MoE layer's top-k sum run inside the next RMSNorm's launch (up to K3RUN_MOE_COMBINE_IN_NORM tokens):
the routed experts' grouped path returns a PendingCombine (per-pick outputs and routing weights) and
`RMSNorm.add` sums it in the norm's launch (`kernels/norm.add_combine_rms_norm`, the rms_norm kernel's
combine mode).

The residual stream s = x + combine(y, w) is computed with the combine kernel's operations in its order (slot
by slot in fp32, rounded to x's dtype, plus the shared add rounded again, plus x rounded again), so it equals
the two-launch path bit for bit where both run the same arithmetic (the interpreter; the CPU path, which
materialises the combine); on a GPU the compiler may contract the multiply-adds differently in the two
kernels, so the GPU test bounds the normalised output by RTOL[bf16] and requires s within one bf16 ulp.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.moe_ops import PendingCombine, combine
from k3run.layers.norm import RMSNorm
from k3run.testing import RTOL, assert_close, output_ulp
from tests.interpreter_utils import interp_only, run_interp_tests_in_child
from tests.layers.test_moe_shared_fusion import _grouped_on_the_cpu, _moe, _process


def _case(t: int, a: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype).to(device)
    y = torch.randn(t * a, d, generator=g).to(dtype).to(device)
    w = torch.rand(t, a, generator=g).to(device)
    add = torch.randn(t, d, generator=g).to(dtype).to(device)
    nw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(device)
    return x, y, w, add, nw


def _check_kernel(t: int, a: int, d: int, dtype: torch.dtype, device: str, with_add: bool) -> None:
    """The rms_norm kernel's combine mode against the combine kernel followed by the add + norm kernel."""
    from k3run.kernels.moe_ops.triton import combine_triton
    from k3run.kernels.norm.triton import rms_norm_triton

    x, y, w, add, nw = _case(t, a, d, dtype, device, seed=t + a)
    add = add if with_add else None
    r = combine_triton(y, w, dtype, add)
    want_out, want_s = rms_norm_triton(x, nw, 1e-5, residual=r)
    out, s = rms_norm_triton(x, nw, 1e-5, residual=y, combine=(w, add))
    if device == "cpu":  # the interpreter: the same numpy operations in the same order
        assert torch.equal(s, want_s) and torch.equal(out, want_out)
    else:
        assert ((s.float() - want_s.float()).abs() <= output_ulp(want_s.float(), dtype)).all()
        assert_close("combine in norm", want_out.float(), out.float(), rtol=RTOL[dtype])


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=3)


@interp_only
@pytest.mark.parametrize("t, a, d, with_add", [(3, 5, 99, True), (1, 9, 256, False), (4, 2, 40, True)])
def test_interp_combine_in_norm_equals_two_launches(t: int, a: int, d: int, with_add: bool) -> None:
    _check_kernel(t, a, d, torch.float16, "cpu", with_add)  # d = 40: several rows a program


def test_combine_in_norm_rejects_mismatched_inputs() -> None:
    from k3run.kernels.norm.triton import rms_norm_triton

    x, y, w, add, nw = _case(2, 3, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"y must be torch.float32 \[6, 16\], got torch.float32 \(5, 16\)"):
        rms_norm_triton(x, nw, 1e-5, residual=y[:5], combine=(w, None))
    with pytest.raises(ValueError, match="add must be"):
        rms_norm_triton(x, nw, 1e-5, residual=y, combine=(w, add[:1]))


def test_rms_norm_add_takes_a_pending_combine_on_the_cpu() -> None:
    """Off CUDA a PendingCombine is materialised (the combine, then add + norm): the same bits as the MoE
    returning its sum; its add() is called once, after the sum's picks."""
    x, y, w, add, nw = _case(3, 4, 64, torch.bfloat16, "cpu")
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    norm.weight.data.copy_(nw)
    calls = []
    pending = PendingCombine(y, w, torch.bfloat16, lambda: calls.append(1) or add)
    got = norm.add(x, pending)
    want = norm.add(x, combine(y, w, torch.bfloat16, add))
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_moe_defers_its_sum_on_the_grouped_path(monkeypatch) -> None:
    """KimiMoE(defer=True) on the grouped path (the CPU stand-in for the grouped launches) returns a
    PendingCombine whose sum, through the next norm, equals the block's tensor output through the same norm;
    the shared expert's output joins in add(). Without defer (and on the per-expert loop) it is a tensor."""
    moe, g = _moe("silu", "cpu", torch.bfloat16)
    _process(moe, force_kernels=True)
    x = torch.randn(5, 256, generator=g).bfloat16()
    h = torch.randn(5, 256, generator=g).bfloat16()
    norm = RMSNorm(256, 1e-5, torch.bfloat16)
    assert isinstance(moe(x, defer=True), torch.Tensor)  # no grouped launches on the CPU: nothing deferred
    sch = moe.experts.scheme
    monkeypatch.setattr(sch, "grouped_ok", lambda ex, x: True)
    monkeypatch.setattr(sch, "grouped", _grouped_on_the_cpu)
    plain = moe(x)
    pending = moe(x, defer=True)
    assert isinstance(plain, torch.Tensor) and isinstance(pending, PendingCombine) and pending.add is not None
    got, want = norm.add(h, pending), norm.add(h, plain)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t, a, with_add", [(1, 9, False), (8, 8, True), (32, 9, False), (200, 8, True)])
def test_gpu_combine_in_norm_matches_two_launches(t: int, a: int, with_add: bool) -> None:
    _check_kernel(t, a, 2304, torch.bfloat16, "cuda", with_add)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_deferred_sum_through_the_next_norm() -> None:
    """On the real grouped launches (bf16; 1, 5 and 40 tokens; the shared expert apart and fused): the
    deferred sum through the next norm against the block's output through it, within RTOL[bf16]."""
    from tests.layers.test_moe_shared_fusion import _gpu_moe

    for fuse in (False, True):
        moe, g = _gpu_moe("silu", fuse)
        norm = RMSNorm(256, 1e-5, torch.bfloat16).cuda()
        for t in (1, 5, 40):
            x = (torch.randn(t, 256, generator=g) * 2).to("cuda", torch.bfloat16)
            h = torch.randn(t, 256, generator=g).to("cuda", torch.bfloat16)
            pending = moe(x, defer=True)
            assert isinstance(pending, PendingCombine)
            got, want = norm.add(h, pending), norm.add(h, moe(x))
            assert_close(
                f"deferred MoE sum, {t} tokens, fused {fuse}", want[0], got[0], rtol=RTOL[torch.bfloat16]
            )
