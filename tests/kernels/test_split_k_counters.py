"""The split-K arrival counters (kernels/counters.py): buffers that CUDA graphs keep the address of
are never freed, and every one of them can be zeroed after a capture."""

from __future__ import annotations

import weakref

import pytest
import torch

from k3run.kernels.counters import SplitKCounters


def test_a_buffer_handed_out_is_never_dropped() -> None:
    """A larger need makes a new, larger buffer (at least double), and the old one stays referenced, so a
    graph captured with it can still read it; keys (streams) have their own buffers; every buffer comes
    zeroed."""
    c = SplitKCounters(min_size=16)
    dev = torch.device("cpu")
    a = c.get(dev, 1, 10)
    assert a.dtype == torch.int32 and a.numel() == 16 and not a.any()
    assert c.get(dev, 1, 16) is a  # it still fits
    gone = weakref.ref(a)
    b = c.get(dev, 1, 17)
    assert b is not a and b.numel() == 32 and not b.any()
    assert c.get(dev, 1, 100).numel() == 100  # a need beyond the double
    del a, b
    assert gone() is not None, "a smaller buffer was freed: graphs captured with it would read freed memory"
    other = c.get(dev, 2, 5)
    assert other is not c.get(dev, 1, 5)
    assert len(c.every) == 4


def test_zero_all_zeros_the_retired_buffers_too() -> None:
    c = SplitKCounters(min_size=8)
    dev = torch.device("cpu")
    first = c.get(dev, 7, 8)
    second = c.get(dev, 7, 9)
    first.fill_(3)
    second[2] = 1
    c.zero_all()
    assert not first.any() and not second.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_keeps_its_counters_when_a_later_capture_grows_them() -> None:
    """Graph A runs a split-K GEMV whose counters an earlier capture made; a later capture on the same pool
    needs more counters and then allocates and fills temporaries. Replaying A again and again gives the
    eager output bit for bit: A's counters were neither freed to that capture's temporaries nor left
    unzeroed (the capture helper zeros them after each capture)."""
    from k3run.engine.runner import warm_and_capture
    from k3run.kernels.counters import counters
    from k3run.kernels.nvfp4_gemm import GemmConfig, nvfp4_linear, prepare_nvfp4_weight
    from tests.kernels.test_nvfp4_gemm import _random_nvfp4

    dev = torch.device("cuda")
    w, s, gs = _random_nvfp4(520, 4096, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(3, 4096, device="cuda").bfloat16()
    cfg = GemmConfig(gemv=True, split_k=4, smem_stages=2)  # 32 chunks: 4 splits, so the counters are used
    want = nvfp4_linear(x, pw, config=cfg)
    pool = torch.cuda.graph_pool_handle()
    first, _, err = warm_and_capture(lambda: nvfp4_linear(x, pw, config=cfg), dev, pool)
    second, out, err2 = warm_and_capture(lambda: nvfp4_linear(x, pw, config=cfg), dev, pool)
    assert err is None and err2 is None and first is not None and second is not None

    def grow_then_fill() -> torch.Tensor:
        big = counters(dev, 1 << 22)  # the capture stream's buffer grows past every earlier one
        junk = [torch.full((n,), 7, dtype=torch.int32, device=dev) for n in (1 << 14, 1 << 15, 1 << 16)]
        return big[:1] + sum(int(j.numel() > 0) for j in junk)

    third, _, err3 = warm_and_capture(grow_then_fill, dev, pool)
    assert err3 is None and third is not None
    for _ in range(3):
        third.replay()
        second.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), "a captured split-K GEMV read counters another graph overwrote"
