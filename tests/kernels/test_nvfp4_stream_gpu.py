"""The streaming NVFP4 decode kernel (kernels/nvfp4_gemm/gluon_stream.py: persistent programs over contiguous
tile ranges, TMA ring) on an sm_90+ GPU against the fp32 reference; the host-side work split on the CPU."""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.nvfp4_gemm import nvfp4_linear_ref, prepare_nvfp4_weight
from k3run.testing import assert_close
from tests.kernels.test_nvfp4_gemm import BF16_RTOL, FP16_RTOL, _random_nvfp4


def _owners_brute(tiles: int, programs: int, kt: int) -> int:
    bounds = [(p * tiles) // programs for p in range(programs + 1)]
    owner = [p for p in range(programs) for _ in range(bounds[p], bounds[p + 1])]
    return max(len(set(owner[rb * kt : (rb + 1) * kt])) for rb in range(tiles // kt))


@pytest.mark.parametrize("rbs, kt, programs", [(33, 29, 7), (448, 56, 2112), (5, 3, 15), (10, 1, 3), (7, 8, 7)])
def test_max_owners_matches_the_ranges(rbs: int, kt: int, programs: int):
    """max_owners (the split slots per row block) from the closed-form owner of a tile, against the ranges
    themselves (CPU)."""
    from k3run.kernels.nvfp4_gemm.gluon_stream import max_owners

    tiles = rbs * kt
    programs = min(programs, tiles)
    assert max_owners(tiles, programs, kt) == _owners_brute(tiles, programs, kt)


def _sm90() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the streaming kernel needs sm_90+ (TMA)")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize(
    "k, programs, stages, group, cp",
    [
        (3600, None, 6, 1, 0), (3600, 7, 2, 1, 1), (3600, 1000, 3, 1, 0), (3600, 13, 9, 1, 0),
        (2992, None, 2, 4, 0), (2992, None, 2, 4, 1), (2992, 61, 4, 2, 0), (2992, 13, 2, 8, 1),
        (2992, 5, 3, 4, 0), (2992, 500, 2, 4, 1),
    ],
)  # fmt: skip
def test_stream_odd_shapes_bf16(
    poison_empty, m: int, k: int, programs: int | None, stages: int, group: int, cp: int
):  # fmt: skip
    """N = 520 (33 row blocks, the last one partial); K = 3600 (29 tiles, a partial last one) or 2992 (24
    tiles, the last one partial; units of 2 / 4 / 8 tiles per copy); TMA or cp.async copies; bias, per-row global scales; program counts giving row
    blocks inside one program, shared by 2..several programs, and more programs than row blocks; bf16 output
    rounding bounds the relative RMS error (BF16_RTOL). A second launch gives the same bits (counters reset,
    fixed summation order)."""
    _sm90()
    from k3run.kernels.nvfp4_gemm.gluon_stream import nvfp4_gemv_stream

    n = 520
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    ref = nvfp4_linear_ref(x.float(), w, s, gs, bias.float())
    kw = dict(rows=n, programs=programs, stages=stages, group=group, cp_async=bool(cp))
    y = nvfp4_gemv_stream(x, pw.weight, pw.scale_bits, pw.global_scale, bias, **kw)
    assert_close(f"stream m={m} k={k} programs={programs} stages={stages} group={group} cp={cp}", ref, y, rtol=BF16_RTOL)
    assert torch.equal(y, nvfp4_gemv_stream(x, pw.weight, pw.scale_bits, pw.global_scale, bias, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("m, group, cp", [(1, 1, 0), (5, 4, 1), (16, 2, 0), (16, 4, 1)])
def test_stream_fp16_exact_k(poison_empty, m: int, group: int, cp: int):
    """fp16, K a multiple of 128 (the unmasked x path), per-tensor global scale, no bias."""
    _sm90()
    from k3run.kernels.nvfp4_gemm.gluon_stream import nvfp4_gemv_stream

    n, k = 4096 + 48, 7168
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").half()
    y = nvfp4_gemv_stream(x, pw.weight, pw.scale_bits, pw.global_scale, rows=n, group=group, cp_async=bool(cp))
    assert_close(f"stream fp16 m={m}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=FP16_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_stream_pdl_chain_reads_each_previous_output(poison_empty, graph: bool):
    """A chain of launches, each input the previous (NaN-poisoned) output: with PDL each launch fills its ring
    early but must wait for the previous launch before reading x, the counters or the split slots; the chain
    gives the same bits with and without PDL, eager and replayed from a CUDA graph."""
    _sm90()
    from k3run.kernels.nvfp4_gemm.gluon_stream import nvfp4_gemv_stream

    n = k = 2048
    pws = []
    for _ in range(6):
        w, s, gs = _random_nvfp4(n, k, device="cuda")
        pws.append(prepare_nvfp4_weight(w, s, gs / k**0.5, layout="tiled128"))  # keeps |y| ~ |x|
    x0 = torch.randn(1, k, device="cuda").bfloat16()

    def chain(x: torch.Tensor, pdl: bool) -> torch.Tensor:
        for p in pws:  # 45 programs over 128 row blocks x 16 tiles: most row blocks shared
            x = nvfp4_gemv_stream(x, p.weight, p.scale_bits, p.global_scale, rows=n, programs=45, pdl=pdl)
        return x

    want = chain(x0, False)
    assert bool(torch.isfinite(want).all()) and want.float().abs().max() > 0
    assert torch.equal(chain(x0, True), want)
    if graph:
        static_x = x0.clone()
        chain(static_x, True)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(static_x, True)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
