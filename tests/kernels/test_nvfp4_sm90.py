"""The CUDA C++ NVFP4 GEMM for sm_90 (kernels/nvfp4_gemm/w4a16_sm90.cu) against the fp32 reference, and its
sm_90a compile on the CPU (nvcc, when this machine has one).

Error bound (elementwise, from the dtypes; test_nvfp4_tile.py's argument): the decoded weights are exact in
16-bit floats, so every product x_k * w_k is exact in fp32 and the kernel and the reference differ only in the
order of K fp32 additions (split-K adds one fixed-order level): |out - ref| <= 3 K u (|x| @ |W|^T) |gs| + one
output ulp (the single rounding to the 16-bit output dtype).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from k3run.formats import dequantize_nvfp4
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90
from k3run.knobs import knobs, reset_knobs
from tests.kernels.test_nvfp4_tile import _bound, _random_nvfp4
from tests.kernels.test_nvfp4_wgmma import _loops, _sass_code, check_tiled_gemm, wgmma_register_hazards
from tests.test_bench_tools import bench_module


def _need_kernel():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if not sm90.available():
        pytest.fail(f"the sm_90 CUDA GEMM did not build: {sm90._error}")


def _case(m, n, k, dtype, per_row, bias, config=None, seed=0):
    def gemm(x, tw, b):
        return sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b, config=config)

    return check_tiled_gemm(gemm, f"sm90 gemm {config}", m, n, k, dtype, per_row, bias, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 100, 255, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_odd_shapes(poison_empty, m: int, dtype: torch.dtype) -> None:
    """Odd M (token tiles with rows past M; 300 and 1000 take several 128-token tiles), N not a multiple of
    the CTA's rows (200: 208 tiled rows, the CTA's last row blocks absent), K = 336 (padded to 384),
    per-row scales and a bias."""
    _need_kernel()
    _case(m, 200, 336, dtype, per_row=m % 2 == 0, bias=m in (17, 255, 300))
    _case(m, 1024, 1024, dtype, per_row=False, bias=False)


# Launch configs the GPU tests name, with the K chunk counts they run them at (K = 720 / 768: 6 chunks; 2048:
# 16). test_test_configs_are_launches_the_kernel_has checks them on the CPU: a config outside the shared
# memory is refused by the wrapper, which would fail the GPU test for the test's own reason.
CONFIGS = [(16, 1, 1, 2), (32, 2, 2, 3), (64, 1, 3, 4), (64, 2, 6, 2), (128, 2, 2, 5), (128, 1, 1, 6),
           (256, 1, 1, 3), (256, 1, 3, 2), (128, 3, 1, 4), (128, 3, 3, 2)]  # fmt: skip
REPEAT_CONFIGS = [(128, 2, 8, 4), (128, 2, 1, 5)]


def test_test_configs_are_launches_the_kernel_has() -> None:
    assert all(sm90.config_ok(*c, 6) for c in CONFIGS), [c for c in CONFIGS if not sm90.config_ok(*c, 6)]
    assert all(sm90.config_ok(*c, 16) for c in REPEAT_CONFIGS)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_configs(poison_empty, config) -> None:
    """Every token tile, one, two and three consumer warpgroups (three: 192 weight rows a CTA, N = 328 / 336
    ends inside the second tile), split-K with 6, 3, 2 and 1 chunk per CTA (odd and even chunk counts: the
    loop's pair and its tail), rings of 2 to 6 slots (deeper than the chunks too)."""
    _need_kernel()
    _case(150, 328, 720, torch.bfloat16, per_row=True, bias=True, config=config)
    _case(40, 336, 768, torch.float16, per_row=False, bias=False, config=config)


# stream-K launches: (BT, stages, CTAs or None for stream_k_ctas); the test shapes' chunk pairs (K = 2048: 8 a
# tile) split unevenly over 7 and 13 CTAs, a CTA of one tile's part, one CTA of everything, one a pair
SK_CASES = [(16, 4, None), (16, 3, 7), (32, 2, 13), (64, 5, 1), (128, 2, None), (256, 3, 11),
            (16, 8, "pairs")]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("bt, stages, ctas", SK_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_stream_k(poison_empty, bt, stages, ctas, dtype) -> None:
    """Stream-K (split_k 0) against the fp32 reference: odd M and N (token tiles and CTA rows past them),
    per-row scales and a bias, CTA counts that split tiles unevenly, down to one chunk pair a CTA."""
    _need_kernel()
    for m, n, per_row, bias in ((37, 328, True, True), (bt, 1024, False, False)):
        tiles = -(-n // 64) * -(-m // bt)
        sk = tiles * 8 if ctas == "pairs" else ctas

        def gemm(x, tw, b, n=n, sk=sk):
            cfg = (bt, 1, 0, stages)
            return sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, n, b, config=cfg,
                                        sk_ctas=sk)  # fmt: skip

        check_tiled_gemm(gemm, f"sm90 stream-K {bt} {sk}", m, n, 2048, dtype, per_row, bias, 0)


# the tail split: (m, n, config, whole-tile CTAs or None for tail_split's choice); two warpgroups at BT 128
# (the default's form), one warpgroup too (the same segment kernels), odd M and N, every whole-tile count,
# and the default's case: 192 tiles on an H100's or H200's 132 SMs (132 whole, 60 in two pieces)
TAIL_CASES = [(300, 1000, (128, 2, -2, 3), None), (300, 1000, (128, 2, -2, 4), 0),
              (300, 1000, (128, 2, -4, 2), 5), (130, 328, (128, 2, -2, 4), 5),
              (37, 328, (16, 1, -2, 4), None), (100, 1024, (64, 1, -4, 3), 3),
              (256, 12288, (128, 2, -2, 4), None)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, config, whole", TAIL_CASES)
def test_gpu_tail_split(poison_empty, m, n, config, whole) -> None:
    """The tail split (split_k -s: whole tiles for the full waves' CTAs, the rest in s pieces) against the
    fp32 reference, per-row scales and a bias, bf16; then ten calls give the same bits (each split tile's
    two or four partials summed in piece order, whichever CTA arrives last)."""
    _need_kernel()

    def gemm(x, tw, b):
        return sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, n, b, config=config,
                                    sk_whole=whole)  # fmt: skip

    name = f"sm90 tail split {config} {whole}"
    out = check_tiled_gemm(gemm, name, m, n, 2048, torch.bfloat16, True, True, 0)
    w, s, gs = _random_nvfp4(n, 2048, "cuda", True, seed=5)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
    outs = [gemm(x, tw, None) for _ in range(10)]
    assert out.shape == (m, n) and all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.gpu
def test_gpu_stream_k_repeats_are_bit_identical_and_the_linear_takes_it(monkeypatch) -> None:
    """Ten stream-K calls give the same bits (the partials summed in the tile's piece order, whichever CTA
    arrives last); with K3RUN_SM90_STREAM_K=32 nvfp4_linear's 32 rows of 7168 x 7168 (the CUDA GEMM's range
    starts at 17) run it (`sm90_config` says split_k 0) within the bound of the fixed split's output."""
    from k3run.kernels.nvfp4_gemm import nvfp4_linear

    _need_kernel()
    w, s, gs = _random_nvfp4(1024, 2048, "cuda", False, seed=3)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(100, 2048, device="cuda").to(torch.bfloat16)
    outs = [
        sm90.nvfp4_sm90_gemm(
            x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 1024, config=(16, 1, 0, 4), sk_ctas=97
        )
        for _ in range(10)
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    n = k = 7168
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=4)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(32, k, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fixed_cfg = sm90.sm90_config(32, n, k, sms, stream_k=False)
    fixed = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=fixed_cfg)
    launches = []  # the stream-K CTA count of each GEMM launch
    real = sm90._module

    class Spy:
        w4a16_prep_x = staticmethod(real.w4a16_prep_x)

        @staticmethod
        def w4a16_gemm(*args):
            launches.append(args[-2])  # sk (pdl is last)
            return real.w4a16_gemm(*args)

    monkeypatch.setenv("K3RUN_SM90_STREAM_K", "32")
    reset_knobs()
    assert fixed_cfg[2] > 0 and sm90.sm90_config(32, n, k, sms)[2] == 0
    monkeypatch.setattr(sm90, "_module", Spy)
    y = nvfp4_linear(x, tw)
    assert len(launches) == 1 and launches[0] > 0, launches
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    assert bool(((y.float() - fixed.float()).abs() <= 2 * _bound(x, wd, gs, ref, torch.bfloat16)).all())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n, config, sk",
    [(9, 328, (16, 1, 2, 4), None), (100, 1000, (64, 1, 1, 3), None), (37, 1024, (32, 1, 0, 3), 7),
     (200, 584, (256, 1, 1, 3), None), (70, 1024, (64, 2, 2, 3), None), (9, 40, (16, 1, 1, 2), None),
     (20, 16, (32, 1, 2, 3), None), (33, 200, (32, 2, 4, 2), None), (130, 1000, (128, 2, 1, 3), None),
     (300, 1000, (128, 2, -2, 3), None)],
)  # fmt: skip
def test_gpu_producer_forms_give_the_same_bits(poison_empty, m, n, config, sk) -> None:
    """The producer's forms (one thread; the whole warp with one elected lane issuing; that with tensor-map
    copies of the CTA's 4 or 8 row blocks, the rows past the last one zero-filled) put the same bytes into
    the same slots, so the output is bit-identical: odd shapes, a partial last row block, the fixed grid,
    split-K, stream-K, the tail split, two consumer warpgroups (an 8-block box; 200 rows: 13 blocks, the
    second CTA's box three past the end), and matrices of three and one row blocks (the box reaching past
    the last)."""
    _need_kernel()
    k = 2048
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=11)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    outs = [
        sm90.nvfp4_sm90_gemm(
            x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=config, sk_ctas=sk, producer=form
        )
        for form in sm90.PRODUCERS
    ]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    assert bool(((outs[0].float() - ref).abs() <= _bound(x, wd, gs, ref, torch.bfloat16)).all())


@pytest.mark.gpu
def test_gpu_repeats_are_bit_identical() -> None:
    """No race: ten calls of one split-K case (fixed-order partial sums) and of one unsplit case give the
    same bits."""
    _need_kernel()
    w, s, gs = _random_nvfp4(1024, 2048, "cuda", False, seed=3)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(100, 2048, device="cuda").to(torch.bfloat16)
    for cfg in REPEAT_CONFIGS:
        outs = [
            sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 1024, config=cfg)
            for _ in range(10)
        ]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_equals_plain_launches(graph: bool) -> None:
    """With programmatic dependent launch each call's x is the previous call's output (plus a torch kernel
    between some of them), so a GEMM or its x preparation reading x, or writing y / the split-K partials /
    the counters, before the kernel ahead of it is done would change bits. Six chained calls over
    REPEAT_CONFIGS and the default config, eagerly and replayed from a CUDA graph, equal the same chain of
    plain launches bit for bit."""
    _need_kernel()
    n = k = 2048
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=5)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x0 = torch.randn(48, k, device="cuda").to(torch.bfloat16)

    def chain(pdl: bool) -> torch.Tensor:
        x = x0
        for i, cfg in enumerate([*REPEAT_CONFIGS, None] * 2):
            y = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=cfg, pdl=pdl)
            # keep the values O(1); every other step through a torch kernel, else straight into the next call
            x = y / y.abs().amax().clamp_min(1e-3) if i % 2 else y * 0.0625
        return x

    plain = chain(False)
    if not graph:
        assert torch.equal(chain(True), plain)
        return
    _graph_replays_equal(lambda: chain(True), plain)


def _graph_replays_equal(run, want: torch.Tensor) -> None:
    """run() once outside a capture (the warm-up), then captured in a CUDA graph: three replays each give
    want's bits."""
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# the x gather: (m, n, k, config); odd M (rows past M zero), K = 720 (a part chunk: columns past K zero),
# split-K, rings shallower and deeper than the chunks, both token tiles it takes
GATHER_CASES = [(9, 328, 720, (16, 1, 2, 3)), (17, 1000, 2048, (32, 1, 2, 4)), (32, 200, 336, (32, 1, 1, 2)),
                (5, 64, 128, (16, 1, 1, 2)), (16, 130, 720, (16, 1, 3, 6))]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, config", GATHER_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_x_gather_equals_prep_x(poison_empty, m, n, k, config, dtype) -> None:
    """The x gather (x copied by tensor map, permuted by the consumers) lays each slot's x out exactly as
    prep_x's tiles bring it, so the output is bit-identical to the prep_x path: both producer forms it takes,
    x with a row stride wider than K (a column slice), within the fp32 reference's bound."""
    _need_kernel()
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=13)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    wide = torch.randn(m, k + 24, device="cuda").to(dtype)
    for x in (wide[:, :k].contiguous(), wide[:, :k]):
        want = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=config,
                                    gather=False)  # fmt: skip
        for form in ("warp", "tensor"):
            got = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=config,
                                       producer=form, gather=True)  # fmt: skip
            assert torch.equal(got, want), (form, x.stride())
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    assert bool(((want.float() - ref).abs() <= _bound(x, wd, gs, ref, dtype)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_x_gather_pdl_chain_equals_plain_launches(graph: bool) -> None:
    """Six chained gathered calls with PDL (each x the previous output, a torch kernel between some), eagerly
    and from a CUDA graph, equal the prep_x path's plain launches bit for bit: the producer reads x only after
    the kernel ahead of it is done."""
    _need_kernel()
    n = k = 2048
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=7)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x0 = torch.randn(24, k, device="cuda").to(torch.bfloat16)

    def chain(pdl: bool, gather: bool) -> torch.Tensor:
        x = x0
        for i, cfg in enumerate([(32, 1, 2, 4), (16, 1, 4, 3), None] * 2):
            y = sm90.nvfp4_sm90_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, config=cfg, pdl=pdl,
                                     gather=gather)  # fmt: skip
            x = y / y.abs().amax().clamp_min(1e-3) if i % 2 else y * 0.0625
        return x

    plain = chain(False, False)
    if not graph:
        assert torch.equal(chain(True, True), plain)
        return
    _graph_replays_equal(lambda: chain(True, True), plain)


@pytest.mark.gpu
def test_gpu_linear_takes_it_and_matches_the_gluon_kernel(monkeypatch) -> None:
    """With K3RUN_SM90_CUDA=1, nvfp4_linear's choice for 17..256 rows on sm_90 runs this kernel on a matrix of
    MIN_WEIGHTS weights; its output is within the bound of the Gluon wgmma kernel's (the same products,
    summed in another order)."""
    from k3run.kernels.nvfp4_gemm import choose_config, nvfp4_linear
    from k3run.kernels.nvfp4_gemm.wgmma import nvfp4_wgmma_gemm

    _need_kernel()
    monkeypatch.setenv("K3RUN_SM90_CUDA", "1")
    reset_knobs()
    n, k = 8192, 4096
    assert choose_config(64, n, k, wgmma=True).wgmma and sm90.takes(n, k)
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=5)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    y = nvfp4_linear(x, tw)
    y_gluon = nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    bound = 2 * _bound(x, wd, gs, ref, torch.bfloat16)
    assert bool(((y.float() - y_gluon.float()).abs() <= bound).all())


def _spy_rows(monkeypatch, name: str) -> list[int]:
    """The rows of x of every call to sm90.<name> from now on (the call itself goes through)."""
    calls: list[int] = []
    real = getattr(sm90, name)

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(sm90, name, spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("m", [257, 1024])
def test_gpu_linear_takes_it_above_256_rows(monkeypatch, m) -> None:
    """257..MAX_M rows of a matrix it takes run this kernel (not dequantize + cuBLAS), within the bf16 bound
    of the fp32 reference; past MAX_M they do not."""
    from k3run.kernels.nvfp4_gemm import nvfp4_linear

    _need_kernel()
    monkeypatch.setenv("K3RUN_SM90_CUDA", "1")
    reset_knobs()
    n, k = 8200, 4096  # 32.0M weights, a partial last row block
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=6)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    calls = _spy_rows(monkeypatch, "nvfp4_sm90_gemm")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = nvfp4_linear(x, tw)
    assert calls == [m] and sm90.MAX_M >= 1024
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    assert bool(((y.float() - ref).abs() <= _bound(x, wd, gs, ref, torch.bfloat16)).all())
    nvfp4_linear(torch.randn(sm90.MAX_M + 1, k, device="cuda").to(torch.bfloat16), tw)
    assert calls == [m]


# the decode GEMV (gemv_kernel): (m, n, k, split): token tiles of 8 and 16 with columns past M, N padded to
# 16 rows (200 -> 208), odd and even chunk counts (3: the loop's pair and its tail; 18 = Kimi Linear's 2304),
# split-K of 3 and 6 (its partials and counters)
GEMV_CASES = [(1, 200, 384, 1), (3, 1000, 2304, 3), (8, 208, 384, 3), (9, 200, 2304, 6), (16, 1024, 2304, 1),
              (13, 200, 384, 1)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, split", GEMV_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemv(poison_empty, m, n, k, split, dtype) -> None:
    """The CUDA decode GEMV against the fp32 reference within the module docstring's bound, per-row and
    single global scales, with and without a bias; ten calls give the same bits (the split-K partials summed
    in split order whichever warp arrives last)."""
    _need_kernel()

    def gemv(x, tw, b):
        return sm90.nvfp4_sm90_gemv(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b, split_k=split)

    for per_row, bias in ((m % 2 == 1, True), (m % 2 == 0, False)):
        check_tiled_gemm(gemv, f"sm90 gemv split {split}", m, n, k, dtype, per_row, bias)
    w, s_, gs = _random_nvfp4(n, k, "cuda", True, seed=3)
    tw = prepare_nvfp4_weight(w, s_, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").to(dtype)
    first = gemv(x, tw, None)
    assert all(torch.equal(gemv(x, tw, None), first) for _ in range(10))


@pytest.mark.gpu
def test_gpu_gemv_pdl_chain_in_a_graph_equals_plain_launches() -> None:
    """Back-to-back GEMV launches with PDL (each reads the previous one's output), captured in a CUDA graph
    and replayed, give the bits of plain launches: no launch reads x before its predecessor has written it."""
    _need_kernel()
    k = n = 1024
    w, s, gs = _random_nvfp4(n, k, "cuda", False, seed=4)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = (torch.randn(5, k, device="cuda") * 0.1).to(torch.bfloat16)

    def chain(pdl):
        y = x
        for _ in range(6):
            y = sm90.nvfp4_sm90_gemv(y, tw.weight, tw.scale_bits, tw.global_scale, k, n, split_k=2, pdl=pdl)
            y = y * 0.05
        return y

    plain = chain(False)
    _graph_replays_equal(lambda: chain(True), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_linear_takes_the_gemv_where_enabled(monkeypatch, m) -> None:
    """With K3RUN_SM90_GEMV=16 nvfp4_linear runs up to 16 rows of a tiled128 weight with K % 128 == 0 on the
    CUDA GEMV (within the bound of the fp32 reference), and K = 336 on the Gluon kernel; with 0, never."""
    from k3run.kernels.nvfp4_gemm import nvfp4_linear

    _need_kernel()
    calls = _spy_rows(monkeypatch, "nvfp4_sm90_gemv")
    for k, env, want in ((2304, "16", [m]), (336, "16", []), (2304, "0", [])):
        monkeypatch.setenv("K3RUN_SM90_GEMV", env)
        reset_knobs()
        calls.clear()
        w, s, gs = _random_nvfp4(1000, k, "cuda", False, seed=7)
        tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = nvfp4_linear(x, tw)
        assert calls == want, (k, env)
        wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
        ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
        assert bool(((y.float() - ref).abs() <= _bound(x, wd, gs, ref, torch.bfloat16)).all()), (k, env)
    monkeypatch.delenv("K3RUN_SM90_GEMV")
    reset_knobs()


def test_gemv_takes_up_to_its_knob_and_whole_chunks(monkeypatch) -> None:
    """gemv_takes: 1..K3RUN_SM90_GEMV rows (at most GEMV_MAX_M) and K a multiple of 128; off by default."""
    assert not sm90.gemv_takes(1, 2304)
    try:
        monkeypatch.setenv("K3RUN_SM90_GEMV", "8")
        reset_knobs()
        assert sm90.gemv_takes(1, 2304) and sm90.gemv_takes(8, 7168)
        assert not sm90.gemv_takes(9, 2304) and not sm90.gemv_takes(4, 336) and not sm90.gemv_takes(0, 2304)
        monkeypatch.setenv("K3RUN_SM90_GEMV", "17")
        reset_knobs()
        with pytest.raises(ValueError, match="K3RUN_SM90_GEMV"):
            knobs()
    finally:
        monkeypatch.delenv("K3RUN_SM90_GEMV")
        reset_knobs()


def test_large_matrices_only(monkeypatch) -> None:
    """The kernel takes K3's matrices (7168 x 7168 and up), not Kimi Linear's (at most 12448 x 2304), and
    none with K3RUN_SM90_CUDA=0."""
    assert sm90.takes(7168, 7168) and sm90.takes(12288, 7168)
    assert not sm90.takes(12448, 2304) and not sm90.takes(2304, 4096)
    monkeypatch.setenv("K3RUN_SM90_CUDA", "0")
    reset_knobs()
    try:
        assert not sm90.takes(7168, 7168)
    finally:
        monkeypatch.delenv("K3RUN_SM90_CUDA")
        reset_knobs()


def test_refuses_bad_input() -> None:
    w = torch.zeros(32, 64, dtype=torch.uint8)
    s = torch.zeros(32, 8, dtype=torch.uint8)
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        sm90.nvfp4_sm90_gemm(torch.zeros(4, 128), w, s, gs, 128, 32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        sm90.nvfp4_sm90_gemv(torch.zeros(4, 128), w, s, gs, 128, 32)


@pytest.mark.parametrize(
    "m, n, k",
    [(17, 7168, 7168), (64, 7168, 7168), (256, 12288, 7168), (256, 7168, 12288), (1000, 2048, 2304)],
)
def test_config_fits_shared_memory_and_divides_k(m: int, n: int, k: int) -> None:
    chunks = -(-k // 128)
    for stream_k in (False, True):
        bt, nwg, split, stages = sm90.sm90_config(m, n, k, 132, stream_k=stream_k)
        assert bt in sm90.TOKEN_TILES and nwg in sm90.WARPGROUPS and stages >= 2
        assert sm90.config_ok(bt, nwg, split, stages, chunks) and (split > 0 or stream_k)
        assert sm90.smem_bytes(bt, nwg, stages) <= sm90.SMEM_LIMIT
    assert bt >= min(m, 128) and (nwg == 1 or bt <= 128)


def test_stream_k_config_where_the_fixed_grid_leaves_slots_idle(monkeypatch) -> None:
    """With stream-K allowed: 16-128 rows of 7168^2 (112 column tiles: the fixed grid fills 224 of 396
    slots at 16 rows, 112 of 132 at 128) take it; 12288 x 7168 at 16 rows (384 of 396) keeps the fixed grid;
    above 128 rows (two consumer warpgroups, whose segment kernel runs only the tail split) and with an odd
    chunk count it is never taken. K3RUN_SM90_STREAM_K (rows, default 0: never) decides when the caller does
    not."""
    for m in (16, 32, 64, 128):
        bt, nwg, split, stages = sm90.sm90_config(m, 7168, 7168, 132, stream_k=True)
        assert (nwg, split) == (1, 0) and sm90.config_ok(bt, nwg, split, stages, 56), m
        assert sm90.ctas_per_sm(bt, 1, True) * sm90.smem_bytes(bt, 1, stages) <= sm90.SM_SMEM
    assert sm90.stream_k_ctas(16, 112, 56, 132) == 396 and sm90.stream_k_ctas(64, 112, 56, 132) == 264
    assert sm90.stream_k_ctas(256, 112, 56, 132) == 132
    assert sm90.stream_k_ctas(32, 112, 56, 132, stages=8) == 264  # two 103 KB rings an SM, not three
    assert sm90.stream_k_ctas(16, 2, 4, 132) == 2  # one CTA per two chunk pairs at least
    assert sm90.sm90_config(16, 12288, 7168, 132, stream_k=True)[2] == 2
    assert sm90.sm90_config(256, 12288, 7168, 132, stream_k=True)[:3] == (128, 3, 1)  # three fit one wave
    assert sm90.sm90_config(512, 7168, 12288, 132, stream_k=True)[:3] == (128, 2, 1)
    assert sm90.sm90_config(4096, 7168, 7168, 132, stream_k=True)[:3] == (128, 2, 1)
    assert sm90.sm90_config(16, 7168, 7040, 132, stream_k=True)[2] != 0  # 55 chunks
    try:
        for env, takes in ((None, ()), ("32", (16, 17, 32)), ("64", (16, 17, 32, 33, 64))):
            if env is None:
                monkeypatch.delenv("K3RUN_SM90_STREAM_K", raising=False)
            else:
                monkeypatch.setenv("K3RUN_SM90_STREAM_K", env)
            reset_knobs()
            for m in (16, 17, 32, 33, 64, 128, 256):
                assert (sm90.sm90_config(m, 7168, 7168, 132)[2] == 0) == (m in takes), (env, m)
    finally:
        monkeypatch.delenv("K3RUN_SM90_STREAM_K", raising=False)
        reset_knobs()


def test_bt128_takes_two_warpgroups_where_one_warpgroups_tiles_outnumber_the_sms() -> None:
    """At BT 128 (65..128 rows) 12288 rows are 192 one-warpgroup tiles on 132 SMs: two consumer warpgroups
    (96 CTAs, one wave, 4 slots); 7168 rows (112 tiles) keep one warpgroup."""
    assert sm90.sm90_config(128, 12288, 7168, 132, stream_k=False) == (128, 2, 1, 4)
    assert sm90.sm90_config(100, 12288, 7168, 132, stream_k=False) == (128, 2, 1, 4)
    assert sm90.sm90_config(128, 7168, 7168, 132, stream_k=False) == (128, 1, 1, 6)
    assert sm90.sm90_config(64, 12288, 7168, 132, stream_k=False)[1] == 1


def test_above_128_rows_two_warpgroups_share_a_128_token_tile() -> None:
    """129.. rows: BT 128 with two consumer warpgroups, one CTA an SM, a ring of TWO_WG_STAGES slots (~41 KB
    each; 5 would fit); 7168^2 at 256 rows is 112 CTAs (56 column tiles of 128 rows x 2 token tiles) in one
    wave."""
    for m in (129, 256, 4096):
        assert sm90.sm90_config(m, 7168, 7168, 132) == (128, 2, 1, sm90.TWO_WG_STAGES), m
    assert sm90.smem_bytes(128, 2, 5) <= sm90.SMEM_LIMIT < sm90.smem_bytes(128, 2, 6)
    assert sm90.sm90_config(128, 7168, 7168, 132)[1] == 1


def test_from_bt64_the_fixed_grid_keeps_one_deep_ring_an_sm() -> None:
    """From BT 64 split_k stays within one CTA an SM where that fills SM_FILL of the SMs, and the ring is
    as deep as the CTAs an SM actually hold allow: 7168^2 at 64 rows one CTA on 112 SMs with 8 slots,
    12288 x 7168 192 CTAs (two on 60 SMs) with 5; a matrix whose one-CTA grid leaves most SMs idle keeps
    the three-CTA split; up to BT 32 the three-CTA wave stays, its ring sized for the CTAs resident."""
    assert sm90.sm90_config(64, 7168, 7168, 132) == (64, 1, 1, 8)
    assert sm90.sm90_config(48, 7168, 7168, 132) == (64, 1, 1, 8)
    assert sm90.sm90_config(64, 12288, 7168, 132) == (64, 1, 1, 5)
    assert sm90.sm90_config(64, 2304, 2048, 132) == (64, 1, 8, 3)  # 36 tiles: split 8 over 288 CTAs
    assert 2 * sm90.smem_bytes(64, 1, 5) <= sm90.SM_SMEM < 2 * sm90.smem_bytes(64, 1, 6)
    assert sm90.sm90_config(32, 7168, 7168, 132) == (32, 1, 2, 8)  # 224 CTAs: two an SM, 8 slots each
    assert sm90.sm90_config(32, 12288, 7168, 132) == (32, 1, 2, 5)  # 384 CTAs: three an SM


def test_pdl_only_where_a_ring_leaves_no_room_for_a_second_cta() -> None:
    """K3RUN_SM90_PDL's rule against run 174 (H100, 7168^2, PDL / plain): on where it measured 1.06-1.09x,
    off where it measured 0.79-0.98x (a second CTA fits beside a running one)."""
    measured = {(16, 1, 8): 0.98, (32, 1, 6): 1.15, (64, 1, 8): 1.09, (64, 1, 4): 0.80, (64, 2, 6): 1.06,
                (128, 1, 6): 1.08, (128, 2, 4): 1.07}  # fmt: skip
    for (bt, nwg, stages), gain in measured.items():
        on = sm90.pdl_helps(bt, nwg, stages)
        assert not on or gain >= 1.05, (bt, nwg, stages)
        assert on == (2 * sm90.smem_bytes(bt, nwg, stages) > sm90.SM_SMEM)
    assert sm90.pdl_helps(64, 1, 8) and not sm90.pdl_helps(16, 1, 8)


def test_auto_producer_is_tensor_on_the_fixed_grid() -> None:
    assert sm90._producer("auto", 0) == "tensor"  # one or two consumer warpgroups (a 4 / 8-block box)
    assert sm90._producer("auto", 396) == "thread"  # stream-K
    for name in sm90.PRODUCERS:
        assert sm90._producer(name, 0) == name


@pytest.mark.parametrize(
    "tiles, chunks, ctas",
    [(112, 56, 396), (6, 16, 7), (3, 2, 3), (5, 6, 1), (60, 8, 97), (1, 56, 28), (2, 4, 3)],
)
def test_stream_k_segments_cover_every_chunk_once(tiles, chunks, ctas) -> None:
    """The kernel's stream-K walk (stream_k_segments restates for_each_sk_segment and SkSplit::piece): every
    (tile, chunk) in exactly one segment, segments of whole chunk pairs in chunk order, each tile's pieces
    numbered 0..n-1 in CTA order with the same n, n within the workspace depth, CTAs' shares within one
    pair of each other."""
    segs = sm90.stream_k_segments(tiles, chunks, ctas)
    seen = torch.zeros(tiles, chunks, dtype=torch.int32)
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    for b, cta in enumerate(segs):
        for tile, lo, hi, seg, nseg in cta:
            assert lo % 2 == 0 and hi % 2 == 0 and 0 <= lo < hi <= chunks
            seen[tile, lo:hi] += 1
            pieces.setdefault(tile, []).append((b, seg, nseg))
    assert bool((seen == 1).all())
    depth = sm90.stream_k_max_pieces(tiles, chunks, ctas)
    for tile, ps in pieces.items():
        assert [p[1] for p in ps] == list(range(len(ps))) and {p[2] for p in ps} == {len(ps)}, tile
        assert [p[0] for p in ps] == sorted(p[0] for p in ps) and len(ps) <= depth
    shares = [sum(hi - lo for _, lo, hi, _, _ in cta) for cta in segs]
    assert max(shares) - min(shares) <= 2


@pytest.mark.parametrize(
    "tiles, chunks, slots, pieces", [(192, 56, 132, 2), (448, 56, 132, 2), (5, 8, 3, 2), (7, 12, 3, 3),
                                     (4, 6, 8, 3), (1, 8, 4, 4), (9, 4, 4, 2)],
)  # fmt: skip
def test_tail_split_segments(tiles, chunks, slots, pieces) -> None:
    """The tail split (`tail_split`, the partition SkSplit walks with x = q): every (tile, chunk) in exactly
    one segment; the full waves' CTAs a whole tile each, in tile order; every other tile in `pieces` equal
    pieces numbered in CTA order, whose count is the workspace depth."""
    ctas, whole = sm90.tail_split(tiles, slots, pieces)
    rest = tiles % slots if tiles > slots else 0
    assert whole == (tiles - rest if rest else tiles - 1) and ctas == whole + (tiles - whole) * pieces
    segs = sm90.stream_k_segments(tiles, chunks, ctas, whole)
    seen = torch.zeros(tiles, chunks, dtype=torch.int32)
    for b, cta in enumerate(segs):
        if b < whole:
            assert cta == [(b, 0, chunks, 0, 1)], (b, cta)
        else:
            t = whole + (b - whole) // pieces
            lo = (b - whole) % pieces * chunks // pieces
            assert cta == [(t, lo, lo + chunks // pieces, (b - whole) % pieces, pieces)], (b, cta)
        for tile, lo, hi, _, _ in cta:
            seen[tile, lo:hi] += 1
    assert bool((seen == 1).all())
    assert sm90.stream_k_max_pieces(tiles, chunks, ctas, whole) == (pieces if whole < tiles else 1)


def test_tail_split_config_where_the_last_wave_is_at_most_half_full(monkeypatch) -> None:
    """K3RUN_SM90_TAIL_SPLIT (default on): two warpgroups' grids whose last wave is at most half full take
    split_k -2 (12288 x 7168 at 256 rows: 192 tiles on 132 SMs; 7168^2 at 1024 rows: 448), one wave or a
    fuller last wave keep the fixed grid (7168^2 at 256 rows: 112 tiles; 12288 x 7168 at 512 rows: 384);
    the config is one the kernel has; split_k -s must cut the chunk pairs evenly."""
    assert sm90.config_ok(128, 2, -2, 4, 56) and sm90.config_ok(16, 1, -4, 3, 8)
    assert not sm90.config_ok(128, 2, -3, 4, 56) and not sm90.config_ok(64, 2, -2, 4, 56)
    assert not sm90.config_ok(128, 2, -2, 4, 55) and not sm90.config_ok(128, 1, -1, 4, 56)
    monkeypatch.setenv("K3RUN_SM90_THREE_WG", "0")  # where three warpgroups fit one wave they run instead
    try:
        for env, want in ((None, -2), ("0", 1), ("1", -2)):
            if env is None:
                monkeypatch.delenv("K3RUN_SM90_TAIL_SPLIT", raising=False)
            else:
                monkeypatch.setenv("K3RUN_SM90_TAIL_SPLIT", env)
            reset_knobs()
            assert sm90.sm90_config(256, 12288, 7168, 132) == (128, 2, want, 4)
            assert sm90.sm90_config(1024, 7168, 7168, 132)[2] == want
            assert sm90.sm90_config(256, 7168, 7168, 132)[2] == 1
            assert sm90.sm90_config(512, 12288, 7168, 132)[2] == 1
            assert sm90.sm90_config(256, 12288, 7040, 132)[2] == 1  # 55 chunks
    finally:
        monkeypatch.delenv("K3RUN_SM90_TAIL_SPLIT", raising=False)
        monkeypatch.delenv("K3RUN_SM90_THREE_WG", raising=False)
        reset_knobs()
    assert sm90.sm90_config(256, 12288, 7168, 132, stream_k=False)[2] == 1


def test_three_warpgroups_where_their_waves_take_no_longer(monkeypatch) -> None:
    """K3RUN_SM90_THREE_WG (default on): above 128 rows, three consumer warpgroups (192 weight rows, the fixed
    grid, a ring of 4 slots: 5 exceed the shared memory) where their waves x 3 do not exceed two warpgroups'
    waves x 2 (the tail split's half wave counted), ties going to three where N is a multiple of 192:
    12288 x 7168 at 129-256 rows (one wave of 128 CTAs against 1.5 of 192), at 512 and 1024 rows (2 x 3 =
    3 x 2 and 4 x 3 = 6 x 2); 7168-row matrices keep two (38 tiles of 192, the last a third full: 7168^2 at
    256 rows is one wave of 112 two-warpgroup tiles); at most 128 rows nothing changes."""
    assert sm90.three_wg_pays(256, 12288, 132) and sm90.three_wg_pays(129, 12288, 132)
    assert sm90.three_wg_pays(512, 12288, 132) and sm90.three_wg_pays(1024, 12288, 132)
    assert not sm90.three_wg_pays(256, 7168, 132) and not sm90.three_wg_pays(1024, 7168, 132)
    assert not sm90.three_wg_pays(128, 12288, 132)  # 96 tiles of 128 rows: one wave
    assert not sm90.three_wg_pays(256, 12288 + 192 * 3, 132)  # 134 three-warpgroup tiles: two waves
    assert sm90.smem_bytes(128, 3, 4) <= sm90.SMEM_LIMIT < sm90.smem_bytes(128, 3, 5)
    try:
        for env, want in ((None, (128, 3, 1, 4)), ("0", (128, 2, -2, 4)), ("1", (128, 3, 1, 4))):
            if env is None:
                monkeypatch.delenv("K3RUN_SM90_THREE_WG", raising=False)
            else:
                monkeypatch.setenv("K3RUN_SM90_THREE_WG", env)
            reset_knobs()
            assert sm90.sm90_config(256, 12288, 7168, 132) == want, env
            assert sm90.sm90_config(256, 7168, 7168, 132) == (128, 2, 1, 4), env
            assert sm90.sm90_config(512, 12288, 7168, 132)[1] == want[1], env
            assert sm90.sm90_config(1024, 7168, 12288, 132)[1] == 2, env
            assert sm90.sm90_config(128, 12288, 7168, 132)[1] == 2, env
            assert sm90.config_ok(*sm90.sm90_config(256, 12288, 7168, 132), 56)
    finally:
        monkeypatch.delenv("K3RUN_SM90_THREE_WG", raising=False)
        reset_knobs()


def test_producer_names_match_the_kernel_constants(monkeypatch) -> None:
    """PRODUCERS index the .cu file's PRODUCER_* constants in order, K3RUN_SM90_PRODUCER takes each of them
    (its parser lists the names on its own), and refuses any other name."""
    src = sm90.cuda_source()
    consts = dict(re.findall(r"PRODUCER_(\w+) = (\d)", src))
    assert {name.upper(): str(i) for i, name in enumerate(sm90.PRODUCERS)} == consts
    try:
        for name in sm90.PRODUCERS:
            monkeypatch.setenv("K3RUN_SM90_PRODUCER", name)
            reset_knobs()
            assert knobs().sm90_producer == name
        monkeypatch.setenv("K3RUN_SM90_PRODUCER", "tma")
        reset_knobs()
        with pytest.raises(ValueError, match="K3RUN_SM90_PRODUCER"):
            knobs()
    finally:
        monkeypatch.delenv("K3RUN_SM90_PRODUCER")
        reset_knobs()


def test_wrappers_cover_every_token_tile_and_dtype() -> None:
    src = sm90.cuda_source()
    assert "//@@WGMMA@@" not in src
    for bt in sm90.TOKEN_TILES:
        for ty in ("bf16", "f16"):
            assert f"m64n{bt}k16.f32.{ty}.{ty} {{%0," in src


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/usr/local/cuda-13.0/bin"):
        if Path(root, name).exists():
            return str(Path(root, name))
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(p) if p.exists() else None
    except ImportError:
        return None


def _cubin(d: Path, source: str, define: str) -> tuple[str, str, Path]:
    """`source` compiled for sm_90a without torch (-D`define`: its standalone instantiations): ptxas's report,
    the cuobjdump tool and the cubin; skips where nvcc, cuobjdump or sm_90a support is missing."""
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    (d / "k.cu").write_text(source)
    cmd = [nvcc, f"-D{define}", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-cubin",
           "-Xptxas", "-v", "-o", str(d / "k.cubin"), str(d / "k.cu")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and "Unsupported gpu architecture" in res.stderr:
        pytest.skip(f"this nvcc cannot build sm_90a: {res.stderr[:200]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr + res.stdout, cuobjdump, d / "k.cubin"


def _standalone_sass(d: Path, source: str) -> tuple[str, str]:
    """A variant of the GEMM's .cu (`source`) compiled for sm_90a without torch, every kernel instantiated:
    ptxas's report and the SASS."""
    report, cuobjdump, cubin = _cubin(d, source, "K3W_STANDALONE")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=300)
    assert sass.returncode == 0, sass.stderr
    return report, sass.stdout


@pytest.fixture(scope="module")
def standalone_build(tmp_path_factory):
    """The .cu file compiled for sm_90a without torch (every kernel instantiated): ptxas's report and SASS."""
    return _standalone_sass(tmp_path_factory.mktemp("sm90"), sm90.cuda_source())


def test_compiles_without_serialized_wgmma_or_spills(standalone_build) -> None:
    """ptxas serializes no wgmma (C7513 / C7515 ...) and spills nothing, in every instantiation; the decode
    GEMV may keep at most 8 bytes of its prologue's values in local memory over its K loop (one store and one
    load a warp; `test_gemv_loop_is_short_and_waits_before_x` pins that none is inside the loop)."""
    report, _ = standalone_build
    assert "wgmma.mma_async instructions are serialized" not in report, report
    props = re.findall(
        r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores", report
    )
    assert props and len(props) == report.count("Compiling entry function"), report
    for name, frame, spill in props:
        allowed = 8 if "gemv_kernel" in name else 0
        assert int(frame) <= allowed and int(spill) <= allowed, (name, frame, spill)


def test_pdl_and_the_split_k_fixup_without_seq_cst_fences(standalone_build) -> None:
    """Every kernel lets the next launch (griddepcontrol.launch_dependents: PREEXIT) and waits for the
    previous one (griddepcontrol.wait: ACQBULK) before its first global read of x; the GEMM kernels' split-K
    fix-up is one thread's acq_rel atomic between barriers, with no seq_cst fence (MEMBAR.SC) left."""
    _, sass = standalone_build
    kernels = re.split(r"\n\s+Function : ", sass)[1:]
    gemm = [f for f in kernels if f.startswith("_ZN3k3w12w4a16_kernel")]
    prep = [f for f in kernels if f.startswith("_ZN3k3w13prep_x_kernel")]
    assert len(gemm) == 18 and len(prep) == 1
    for f in gemm + prep:
        name = f.split("\n")[0]
        assert "PREEXIT" in f and "ACQBULK" in f and "MEMBAR.SC" not in f, name
    code = [i for _, i in _sass_code(prep[0])]
    first_load = next(j for j, i in enumerate(code) if re.search(r"\bLDG", i))
    assert any("ACQBULK" in i for i in code[:first_load]), "prep_x reads x before its griddepcontrol.wait"
    for f in gemm:
        assert sum("ATOMG" in i for _, i in _sass_code(f)) == 1, f.split("\n")[0]


def test_x_gather_reads_after_the_wait_and_fences_its_stores(standalone_build) -> None:
    """The x gather (one consumer warpgroup, BT 16 / 32, the fixed grid): in SASS x comes by 2-D tensor-map
    copies (UTMALDG.2D) after a griddepcontrol.wait (ACQBULK) in code order, with no thread load of x
    (LDG.E.128, LDGSTS); the consumers' permute of a slot (STS.128) is followed by fence.proxy.async
    (FENCE.VIEW.ASYNC.S) before the warpgroup's named barrier (BAR.SYNC) and before any wgmma (HGMMA):
    the wgmma reads the stores through the async proxy."""
    _, sass = standalone_build
    kernels = re.split(r"\n\s+Function : ", sass)[1:]
    for bt in (16, 32):
        f = next(f for f in kernels if f.startswith(f"_ZN3k3w12w4a16_kernelILi{bt}ELi1ELb1ELb0E"))
        listing = _sass_code(f)
        code = [i for _, i in listing]
        copies = [j for j, i in enumerate(code) if "UTMALDG.2D" in i]
        waits = [j for j, i in enumerate(code) if "ACQBULK" in i]
        assert copies and all(any(w < j for w in waits) for j in copies), bt
        assert not any(re.search(r"LDG\.E\.128 |LDGSTS", i) for i in code), bt
        stores = [j for j, i in enumerate(code) if "STS.128" in i]
        assert stores and len(stores) % 8 == 0, bt  # a permuting thread writes a row half's 8 units
        for j in stores:
            assert _fence_before(listing, j, "BAR.SYNC"), (bt, j)
            assert _fence_before(listing, j, "HGMMA"), (bt, j)


def _fence_before(listing: list, j: int, stop: str) -> bool:
    """From instruction j on, following unconditional branches (ptxas moves a diverged path out of line and
    branches back): a FENCE.VIEW.ASYNC.S comes before the first instruction holding `stop`."""
    where = {a: n for n, (a, _) in enumerate(listing)}
    fenced, n, steps = False, j + 1, 0
    while n < len(listing) and steps < 10_000:
        i, steps = listing[n][1], steps + 1
        if stop in i:
            return fenced
        fenced = fenced or "FENCE.VIEW.ASYNC.S" in i
        jump = re.fullmatch(r"BRA (0x[0-9a-f]+)", i.strip())
        n = where[int(jump.group(1), 16)] if jump else n + 1
    return False


def _pair_loops(code):
    """The innermost loops holding HGMMA: each GEMM kernel's K loop over chunk pairs (the stream-K kernels
    hold it inside their segment loop). Branches back from past the last EXIT are not loops: ptxas puts a
    __syncwarp's diverged-warp path (WARPSYNC.COLLECTIVE) out of line there and branches back."""
    end = max(a for a, i in code if i == "EXIT")
    loops = [(lo, hi) for lo, hi in _loops(code) if hi < end]
    loops = [(lo, hi) for lo, hi in loops if any("HGMMA" in i for a, i in code if lo <= a <= hi)]
    return [r for r in loops if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in loops)]


def test_keeps_a_chunk_in_flight_with_no_register_hazard(standalone_build) -> None:
    """Inside each GEMM kernel's K loop: HGMMAs from registers, waited down to one group (0x1, never 0x0
    inside the loop; the three-warpgroup kernel, one A set a warpgroup, down to none: 0x0), and no instruction
    writes a register of an A operand still in flight (12 fixed-grid kernels, 6 segment kernels: stream-K's
    five, the tail split's two-warpgroup one)."""
    _, sass = standalone_build
    kernels = [f for f in re.split(r"\n\s+Function : ", sass) if f.startswith("_ZN3k3w12w4a16_kernel")]
    assert len(kernels) == 18
    for f in kernels:
        code = _sass_code(f)
        assert wgmma_register_hazards(f) == [], f.split("\n")[0]
        loops = _pair_loops(code)
        assert len(loops) == 1, f.split("\n")[0]
        lo, hi = loops[0]
        body = [i for a, i in code if lo <= a <= hi]
        waits = [i for i in body if "WARPGROUP.DEPBAR" in i]
        depth = "0x0" if f.startswith("_ZN3k3w12w4a16_kernelILi128ELi3E") else "0x1"
        assert waits and all(w.endswith(depth) for w in waits), (f.split("\n")[0], waits)
        assert sum("HGMMA" in i for i in body) == 16
        assert all(re.search(r"HGMMA\.\S+\s+R\d+,\s+R\d+,", i) for i in body if "HGMMA" in i)


def test_gemv_loop_is_short_and_waits_before_x(standalone_build) -> None:
    """The decode GEMV's SASS: its K loop (two chunks an iteration) holds the chunks' mma.sync (HMMA.16816:
    2 x 8 x BT / 8), no shared memory or barrier, and at most 2 x 160 (BT 16) / 2 x 150 (BT 8) instructions
    (the Gluon kernel's loop: 248 / 202 a chunk); the codes and scales may be read before griddepcontrol.wait
    (ACQBULK), x (the cached loads) only after it; one atomic (split-K), no seq_cst fence, the next launch
    let go (PREEXIT)."""
    _, sass = standalone_build
    gemv = [f for f in re.split(r"\n\s+Function : ", sass) if f.startswith("_ZN3k3w11gemv_kernel")]
    assert len(gemv) == 3  # BT 8, BT 16, BT 8 with the activation epilogue
    for f in gemv:
        name = f.split("\n")[0]
        bt = 8 if "gemv_kernelILi8E" in name else 16
        code = _sass_code(f)
        lo, hi = max(_loops(code), key=lambda r: r[1] - r[0])
        body = [i for a, i in code if lo <= a <= hi]
        assert sum("HMMA.16816" in i for i in body) == 2 * 8 * bt // 8, name
        assert not any(re.search(r"\b(LDS|STS|BAR|LDL|STL)\b", i) for i in body), name
        assert len(body) <= 2 * (170 if bt == 16 else 156), (name, len(body))
        ins = [i for _, i in code]
        wait = next(j for j, i in enumerate(ins) if "ACQBULK" in i)
        x_loads = [j for j, i in enumerate(ins) if re.search(r"\bLDG\S*CONSTANT", i) and ".NA" not in i]
        assert x_loads and min(x_loads) > wait, name
        assert sum("ATOMG" in i for i in ins) == 1 and "MEMBAR.SC" not in f and "PREEXIT" in f, name


def test_k_loop_overheads_stay_out(standalone_build) -> None:
    """What ncu found in run 125 (bench/NOTES.md session 32) stays out of each GEMM kernel's K loop: no
    integer division for the ring's slot (MUFU.RCP), the staged words and scales read by LDS (no generic
    LD), the wgmma descriptors in uniform registers (at most 4 R2UR, where 32 were), and under 480
    instructions per chunk pair (621 at (16, 1) before). The kernels that take the x gather (fixed grid, one
    warpgroup, BT 16 / 32) also hold its permute, skipped where the gather is off: a row half's 8 LDS.128 and
    8 STS.128 a chunk, and under 160 more instructions a pair."""
    _, sass = standalone_build
    for f in [f for f in re.split(r"\n\s+Function : ", sass) if f.startswith("_ZN3k3w12w4a16_kernel")]:
        code = _sass_code(f)
        loops = _pair_loops(code)
        body = [i for a, i in code if any(lo <= a <= hi for lo, hi in loops)]
        name = f.split("\n")[0]
        gather = re.match(r"_ZN3k3w12w4a16_kernelILi(16|32)ELi1ELb[01]ELb0E", name) is not None
        assert not any("MUFU" in i for i in body), name
        assert not any(re.search(r"\bLD\.E", i) for i in body), name
        assert sum("LDS" in i for i in body) == 8 + 16 * gather, name
        assert sum("STS" in i for i in body) == 16 * gather, name
        assert sum("R2UR" in i for i in body) <= 4, name
        assert len(body) < 480 + 160 * gather, (name, len(body))


# ---- the kernel's data movement, modelled on the CPU ------------------------------------------------------
# Each formula below restates one line of w4a16_sm90.cu (prep_x_kernel's unit mapping, the producer's copy
# addresses, the consumer's word / scale offsets and decode_word, the A-register fragment, the B descriptor's
# 128-byte swizzle, the accumulator fragment and the epilogue's indices); wgmma itself is modelled by the PTX
# ISA's fragment layouts. The model run on random data must equal the fp32 reference within the bound: a
# wrong permutation, offset or swizzle in any of them moves values to other rows or columns.


def _model_prep_x(x: torch.Tensor, bt: int, ch: int) -> torch.Tensor:
    """prep_x_kernel: xt [t_tiles, CH, 2, BT, 64] (fp32 here) from x [M, K]."""
    m, k = x.shape
    tiles = -(-m // bt)
    xt = torch.zeros(tiles * ch * 2 * bt * 8, 8)
    idx = torch.arange(xt.shape[0])
    u, rest = idx % 8, idx // 8
    r, rest = rest % bt, rest // bt
    h, rest = rest % 2, rest // 2
    c, tt = rest % ch, rest // ch
    lu = u ^ (r % 8)
    b, p = lu >> 1, lu & 1
    row = tt * bt + r
    for tq in range(4):
        col = c * 128 + h * 64 + 16 * tq + 4 * b + 2 * p
        for e in range(2):
            ok = (row < m) & (col + e < k)
            v = x[row.clamp(max=m - 1), (col + e).clamp(max=k - 1)]
            xt[:, 2 * tq + e] = torch.where(ok, v, torch.zeros_like(v))
    return xt.reshape(tiles, ch, 2, bt, 64)


def _model_decode_word(q: torch.Tensor, s16: torch.Tensor) -> list[torch.Tensor]:
    """decode_word<bf16> after scale_pair: the 4 pairs of words q (int64 holding 32 bits) as fp32 [..., 2]."""
    m32 = 0xFFFFFFFF
    o = [
        q & 0x81C081C0,
        (q << 6) & 0x81C081C0,
        ((q << 5) & 0x80008000) | ((q << 3) & 0x01C001C0),
        ((q << 4) & 0x80008000) | ((q >> 6) & 0x01C001C0),
    ]
    lo_s, hi_s = s16 & 0xFF, (s16 >> 8) & 0xFF
    scale = [torch.tensor(list(range(256)), dtype=torch.uint8).view(torch.float8_e4m3fn).float()[v.long()]
             for v in (lo_s, hi_s)]  # fmt: skip
    out = []
    for j, w in enumerate(o):
        w = w & m32
        halves = torch.stack([w & 0xFFFF, w >> 16], -1).to(torch.int32) << 16
        vals = halves.view(torch.float32)  # bf16 bits as fp32: e2m1 * 2^-126 (subnormal codes included)
        # bf16 scale bits: cvt(e4m3 -> f16) >> 3 + 0x7380 = s * 2^119; product e2m1 * s * 2^-7
        out.append(vals * (scale[0 if j < 2 else 1] * 2.0**119).unsqueeze(-1))
    return out


def _model_gemm(x, weight, scale_u8, gs, k, n, bt, nwg, split):
    """y [M, n] fp32 as the kernel computes it (before the output rounding)."""
    m = x.shape[0]
    n_pad, k_pad = weight.shape[0], weight.shape[1] * 2
    ch = k_pad // 128
    xt = _model_prep_x(x.float(), bt, ch)
    words = weight.view(torch.int32).reshape(-1).to(torch.int64) & 0xFFFFFFFF  # [N_pad/16, CH, 16, 16]
    words = words.reshape(n_pad // 16, ch, 16, 16)
    sbytes = scale_u8.reshape(n_pad // 16, ch, 16, 8).to(torch.int64)
    n_tiles, t_tiles, nch = -(-n // (64 * nwg)), xt.shape[0], ch // split
    y = torch.zeros(m, n)
    g, t = torch.arange(32) // 4, torch.arange(32) % 4
    for pid_n in range(n_tiles):
        for pid_t in range(t_tiles):
            for wg in range(nwg):
                acc = torch.zeros(64, bt)  # rows = the warpgroup's weight rows, columns = tokens
                for sk in range(split):
                    for cc in range(nch):
                        c = sk * nch + cc
                        xs = xt[pid_t, c].reshape(2, bt * 128 // 2)  # the slot's two halves, flat in halves
                        for warp in range(4):
                            rb = pid_n * nwg * 4 + wg * 4 + warp
                            if rb >= n_pad // 16:
                                continue  # the producer copies no row block past the weight
                            a = torch.zeros(8, 16, 16)  # k-step, row in warp, operand column k'
                            for rows in (g, g + 8):
                                q = words[rb, c, rows]  # [32, 16]: each lane's row
                                q = torch.stack(
                                    [q[i, 4 * t[i] : 4 * t[i] + 4] for i in range(32)]
                                )  # its words 4t..4t+3
                                sw = sbytes[rb, c, rows]  # [32, 8]
                                pos = 4 * (t & 1) + 2 * (t >> 1)
                                s16 = sw[torch.arange(32), pos] | (sw[torch.arange(32), pos + 1] << 8)
                                for bb in range(4):
                                    d = _model_decode_word(q[:, bb], s16)  # 4 x [32, 2]
                                    # A regs of k-step bb: {R0 row g p0, R1 row g+8 p0, R2 row g p1, R3 ...}
                                    for kstep, (p0, p1) in ((bb, (d[0], d[1])), (4 + bb, (d[2], d[3]))):
                                        for i in range(32):
                                            r = rows[i]
                                            a[kstep, r, 2 * t[i] : 2 * t[i] + 2] = p0[i]
                                            a[kstep, r, 8 + 2 * t[i] : 8 + 2 * t[i] + 2] = p1[i]
                            for kstep in range(8):
                                # B: token rows of the K-major 128B-swizzled half, 16 columns at 32 (k % 4)
                                half = xs[kstep // 4].reshape(bt, 64)
                                phys = torch.zeros(bt, 16)
                                for kk in range(16):
                                    lbyte = (kstep % 4) * 32 + kk * 2
                                    unit, within = lbyte // 16, lbyte % 16
                                    for tok in range(bt):
                                        pu = unit ^ (tok % 8)
                                        phys[tok, kk] = half[tok, pu * 8 + within // 2]
                                acc[16 * warp : 16 * warp + 16] += a[kstep] @ phys.t()
                # epilogue: thread (warp, g, t) holds d[4i + 2h + e] = acc[16 warp + g + 8h, 8i + 2t + e]
                rows = pid_n * nwg * 64 + wg * 64 + torch.arange(64)
                toks = pid_t * bt + torch.arange(bt)
                rk, tk = rows < n, toks < m
                gsv = gs if gs.numel() == 1 else gs[rows.clamp(max=n_pad - 1)]
                out = acc * (gsv.reshape(-1, 1) if gs.numel() > 1 else gsv) * 128.0
                y[toks[tk][:, None], rows[rk][None, :]] = out[rk][:, tk].t()
    return y


@pytest.mark.parametrize("m, n, k, bt, nwg, split", [(20, 200, 336, 32, 2, 1), (9, 144, 384, 16, 1, 3)])
def test_model_of_the_kernel_indexing_matches_the_reference(m, n, k, bt, nwg, split) -> None:
    """The numpy model of the kernel's layouts (above) against the fp32 reference: rows past M and N, the K
    tail, a CTA whose last row blocks are absent, split-K over chunks, one and two warpgroups."""
    from k3run.testing import assert_within

    w, s, gs = _random_nvfp4(n, k, "cpu", True, seed=11)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = _model_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, bt, nwg, split)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    assert_within(
        f"sm90 model {m}x{n}x{k}", ref, y, 3 * k * 2.0**-24 * ((x.float().abs() @ wd.abs().t()) * gs)
    )


def test_config_ok_refuses_launches_the_kernel_does_not_have() -> None:
    assert sm90.config_ok(128, 2, 2, 4, 56)
    assert not sm90.config_ok(256, 2, 1, 3, 56)  # two warpgroups stop at 128-token tiles
    assert not sm90.config_ok(64, 2, 3, 4, 56)  # split_k must divide the chunks
    assert not sm90.config_ok(48, 1, 1, 4, 56)  # no 48-token tile
    assert not sm90.config_ok(128, 2, 1, 1, 56)  # a ring needs two slots
    assert not sm90.config_ok(256, 1, 1, 4, 56)  # four 68 KB slots exceed the shared memory
    assert sm90.config_ok(128, 3, 1, 4, 56)
    assert not sm90.config_ok(64, 3, 1, 4, 56)  # three warpgroups: 128-token tiles only
    assert not sm90.config_ok(128, 3, 0, 4, 56)  # and the fixed grid: no stream-K
    assert not sm90.config_ok(128, 3, -2, 4, 56)  # nor the tail split
    assert not sm90.config_ok(128, 3, 1, 5, 56)  # five 46 KB slots exceed the shared memory


def _compile_with_torch_headers(tmp_path, source: str, name: str) -> None:
    """`source` compiled as `load_inline` builds it on a GPU machine (torch's headers, the same defines), to
    PTX only. Where torch's CPU wheel lacks its CUDA build-config header, an empty one stands in (it only
    holds build macros)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    nvcc = _tool("nvcc")
    py_include = sysconfig.get_paths()["include"]
    if nvcc is None or not Path(py_include, "Python.h").exists():
        pytest.skip("needs nvcc and Python's headers")
    stub = tmp_path / "inc" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    (tmp_path / "k.cu").write_text(source)
    cmd = [nvcc, "-c", "-std=c++17", "-gencode=arch=compute_90a,code=compute_90a", "--expt-relaxed-constexpr",
           f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
           *[f"-I{p}" for p in include_paths()], f"-I{tmp_path / 'inc'}", f"-I{py_include}",
           "-o", str(tmp_path / "k.o"), str(tmp_path / "k.cu")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and "Unsupported gpu architecture" in res.stderr:
        pytest.skip(f"this nvcc cannot build sm_90a: {res.stderr[:200]}")
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 0, "\n".join(errors[:20]) or res.stderr[-3000:]


def test_compiles_with_torch_headers(tmp_path) -> None:
    """The whole source, launcher included, compiles as `load_inline` builds it (~70 s where nvcc exists):
    the standalone SASS build leaves the launcher out, and a launcher error otherwise shows first on the
    GPU."""
    _compile_with_torch_headers(tmp_path, sm90.cuda_source(), "k3run_w4a16_sm90")


def test_isolate_probe_keeps_its_work(tmp_path) -> None:
    """bench/probes/sm90_isolate.py times the GEMM's consumer chunk in parts, so each part must stay what it
    claims in SASS: no serialized wgmma and no spill in any instantiation; the wgmma-only loop keeps its
    group in flight (DEPBAR.LE gsb0 1, 8 HGMMA a chunk); the decode-only loop keeps its LDS and decode in the
    loop (ptxas hoists loop-invariant shared loads and drops unread registers otherwise); the combined loop
    has both."""
    report, cuobjdump, cubin = _cubin(
        tmp_path, bench_module("probes/sm90_isolate").probe_source(), "K3P_STANDALONE"
    )
    assert "serialized" not in report, report
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == 18 and set(spills) == {"0"}, report
    for bt, nwg in ((16, 1), (64, 2), (128, 2)):
        per_mode = []
        for mode in range(3):
            name = f"_ZN3k3p14isolate_kernelILi{bt}ELi{nwg}ELi{mode}EEEvijPxPj"
            sass = subprocess.run([cuobjdump, "-sass", "-fun", name, str(cubin)],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert sass.returncode == 0, sass.stderr
            code = _sass_code(sass.stdout)
            lo, hi = max(_loops(code), key=lambda r: r[1] - r[0])
            body = [i for a, i in code if lo <= a <= hi]
            per_mode.append(body)
        mma, decode, both = per_mode
        assert sum("HGMMA" in i for i in mma) == 16 and not any("LDS" in i for i in mma), (bt, nwg)
        assert all("DEPBAR.LE gsb0, 0x1" in i for i in mma if "DEPBAR" in i), (bt, nwg)
        assert sum("LDS" in i for i in decode) == 8 and not any("HGMMA" in i for i in decode), (bt, nwg)
        assert sum("HMUL2" in i or "HFMA2" in i for i in decode) == 64, (bt, nwg)
        assert sum("HGMMA" in i for i in both) == 16 and sum("LDS" in i for i in both) == 8, (bt, nwg)


def test_isolate_probe_compiles_with_torch_headers(tmp_path) -> None:
    """The probe's launcher compiles as `load_inline` builds it (a build error would otherwise show first
    on the GPU)."""
    _compile_with_torch_headers(
        tmp_path, bench_module("probes/sm90_isolate").probe_source(), "k3run_sm90_isolate"
    )


def _feed_kernels(tmp_path, variant: str) -> list[str]:
    """The SASS of every GEMM kernel of bench/probes/sm90_feed.py's `variant` build."""
    report, sass = _standalone_sass(tmp_path, bench_module("probes/sm90_feed").feed_source(variant))
    assert "serialized" not in report, report
    gemm = [k for k in sass.split("Function : ")[1:] if k.startswith("_ZN3k3w12w4a16_kernel")]
    assert len(gemm) >= 8, len(gemm)
    return gemm


def test_feed_probe_idles_only_the_consumers(tmp_path) -> None:
    """bench/probes/sm90_feed.py times the GEMM with its consumers idle: those builds must lose every wgmma
    and decode (no HGMMA, no HMUL2 in any kernel) and keep the rest: the ring's waits, the epilogue's stores
    and the copies their variant keeps (feed: x, codes and scales; xonly: x alone, no tensor-map copy of codes
    or scales). Every variant's replacements still find their lines in the GEMM's source."""
    probe = bench_module("probes/sm90_feed")
    for variant in probe.VARIANTS:
        src = probe.feed_source(variant)
        idle = probe.WORK not in src and probe.ISSUE not in src and probe.FEED in src
        assert idle == (variant in probe.IDLE), variant
        assert all(new in src for _, new in probe.VARIANTS[variant]), variant
    for variant in ("feed", "xonly"):
        (tmp_path / variant).mkdir()
        for k in _feed_kernels(tmp_path / variant, variant):
            name = k.split()[0]
            assert "SYNCS.PHASECHK" in k and "UBLKCP" in k and "STG" in k, (variant, name)
            assert "HGMMA" not in k and "HMUL2" not in k, (variant, name)
            # the codes' and scales' tensor-map copies (3-D; the x gather's are 2-D)
            assert ("UTMALDG.3D" in k) == (variant == "feed"), (variant, name)


def test_gather_probe_variants_change_the_gemm_source() -> None:
    """bench/probes/sm90_gather.py's variants each still find their line in the GEMM's source and change it
    (a variant whose line moved would otherwise time the shipped gather under another name)."""
    probe = bench_module("probes/sm90_gather")
    base = sm90.cuda_source()
    for variant, edits in probe.VARIANTS.items():
        src = probe.variant_source(variant)
        assert src != base and all(new in src for _, new in edits), variant


def test_waves_probe_sizes_its_grids() -> None:
    """bench/probes/sm90_waves.py picks N so the fixed grid (split 1) holds the asked CTA count: 132 CTAs of
    (128, 2) at 256 rows are 66 tiles of 128 weight rows x 2 token tiles; a count the token tiles do not
    divide is refused, not rounded."""
    probe = bench_module("probes/sm90_waves")
    for ctas, m, cfg in ((132, 256, (128, 2, 1, 4)), (60, 256, (128, 2, 1, 4)), (33, 16, (16, 1, 1, 8))):
        n = probe.rows_for(ctas, m, cfg)
        assert -(-n // (64 * cfg[1])) * -(-m // cfg[0]) == ctas, (ctas, m, cfg)
    with pytest.raises(ValueError, match="token tiles"):
        probe.rows_for(61, 256, (128, 2, 1, 4))


def test_release_probe_variant_changes_only_the_release() -> None:
    """bench/probes/sm90_release.py's build: every consumer lane arrives on the slot it frees (the empty
    barrier counting 128 a warpgroup), the rest of the GEMM's source unchanged; it refuses a source whose
    release line moved (a variant that silently kept the shipped release would answer the wrong question)."""
    probe = bench_module("probes/sm90_release")
    base, src = sm90.cuda_source(), probe.variant_source()
    assert probe.RELEASE in base and probe.RELEASE not in src and probe.EVERY in src
    assert "mbar_init(&empty[i], NWG * 128);" in src and probe.COUNT not in src
    assert src.replace(probe.EVERY, probe.RELEASE).replace("NWG * 128);", "NWG * 4);") == base


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t, bt, split", [(1, 8, 1), (3, 8, 4), (8, 8, 1), (12, 16, 2), (40, 16, 7), (75, 8, 1)]
)
def test_gpu_gemv_expert_modes(poison_empty, t: int, bt: int, split: int) -> None:
    """The CUDA GEMV's expert modes: expert-major (one group of `expert_groups`' table a program group) gives
    the bits of the per-pick mode (each token column of the mma computed alone, the same K order) for every
    pick, zero rows for other ranks' experts (ids -1 and E), with token rows (slot_div = A, GEMM1) and pick
    rows (slot_div = 1, GEMM2) as x; both within the module docstring's bound of the fp32 reference (the
    Gluon launches' products summed in another order). E = 5, N = 520 (528 tiled rows), K = 3584 (28 chunks,
    split 4 / 7 / 2 dividing them), per-row global scales; T = 40 / 75 put more than bt picks on an expert."""
    from k3run.kernels.nvfp4_gemm.groups import expert_groups
    from tests.kernels.test_nvfp4_gemv_gpu import stacked_experts

    _need_kernel()
    n_exp, n, k, a = 5, 520, 3584, 4
    torch.manual_seed(10 + t)
    ws_, w, s, gs, ids = stacked_experts(n_exp, n, k, t, a, per_row=True)
    grp = expert_groups(ids, n_exp, bt)
    wd = [
        dequantize_nvfp4(q, sc, 1.0, dtype=torch.float32) * gsc.reshape(-1, 1).float() for q, sc, gsc in ws_
    ]
    for xrows, div in ((t, a), (t * a, 1)):
        x = torch.randn(xrows, k, device="cuda").to(torch.bfloat16)
        per_pick = sm90.nvfp4_sm90_gemv_grouped(x, w, s, gs, ids, rows=n, split_k=split)
        by_exp = sm90.nvfp4_sm90_gemv_by_expert(x, w, s, gs, grp, picks=t * a, slot_div=div, rows=n,
                                                split_k=split)  # fmt: skip
        assert torch.equal(by_exp, per_pick), div
        for p_, e in enumerate(ids.tolist()):
            row = x[p_ // div].float()
            if not 0 <= e < n_exp:
                assert not bool(by_exp[p_].any()), p_
                continue
            ref = row @ wd[e].t()
            bound = _bound(row[None], wd[e], torch.ones(1, device="cuda"), ref[None], torch.bfloat16)[0]
            assert bool(((by_exp[p_].float() - ref).abs() <= bound).all()), (p_, e)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("silu", 1.0, None), ("situ", 4.0, None), ("situ", 4.0, 25.0)])
def test_gpu_gemv_activation_epilogue(poison_empty, act) -> None:
    """GEMM1 with the gated activation in the CUDA GEMV's epilogue (8-token tile, per pick and expert-major)
    against its own GEMM1 then moe_ops' gated kernel: gate and up are the same bits in both (the same
    kernel's sums, rounded to bf16), then h in fp32; the epilogue's exp is __expf where the gated kernel's
    is libdevice's (a few fp32 ulps), so h may differ by a bf16 ulp: RTOL[bf16]. 2I = 288 (18 row blocks of
    gate / up pairs; the gate half ends inside a 16-row block), K = 1024, 2 of 3 experts."""
    from k3run.kernels.moe_ops.triton import gated_triton
    from k3run.kernels.nvfp4_gemm.groups import expert_groups
    from k3run.testing import RTOL, assert_close

    _need_kernel()
    n_exp, i2, k, t, a = 3, 288, 1024, 4, 2
    ps = [prepare_nvfp4_weight(*_random_nvfp4(i2, k, "cuda", True, seed=20 + e), layout="tiled128")
          for e in range(n_exp)]  # fmt: skip
    w = torch.stack([p.weight for p in ps])
    s = torch.stack([p.scale_bits for p in ps])
    gs = torch.stack([p.global_scale.reshape(-1) for p in ps])
    ids = torch.tensor([0, 2, 2, 1, 0, 1, 2, 0], dtype=torch.int32, device="cuda")
    grp = expert_groups(ids, n_exp, 8)
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    kind, beta, lb = act
    for split in (1, 2):
        gu = sm90.nvfp4_sm90_gemv_grouped(x, w, s, gs, ids, rows=i2, split_k=split)
        want = gated_triton(gu, kind, beta, lb, torch.bfloat16)
        got = sm90.nvfp4_sm90_gemv_grouped(x, w, s, gs, ids, rows=i2, split_k=split, act=act)
        assert_close(f"gemv act {act} per pick, split {split}", want, got, rtol=RTOL[torch.bfloat16])
        got = sm90.nvfp4_sm90_gemv_by_expert(x, w, s, gs, grp, picks=t * a, slot_div=a, rows=i2,
                                             split_k=split, act=act)  # fmt: skip
        assert_close(f"gemv act {act} by expert, split {split}", want, got, rtol=RTOL[torch.bfloat16])


# The decode GEMV restated the same way (gemv_kernel's lines: the lane's two rows, its words' and scale
# pair's offsets in the block, its x words as the B registers, mma.sync m16n8k16's fragments from the PTX
# ISA, the accumulator's rows and token columns, the activation's gate / up rows).


def _mma16816(a_regs: list, b_regs: list) -> torch.Tensor:
    """D [16, 8] = A @ B from the 32 lanes' registers: a_regs 4 x [32, 2], b_regs 2 x [32, 2] (fp32 values of
    the packed halves), lane = 4 g + t."""
    a = torch.zeros(16, 16)
    b = torch.zeros(16, 8)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            a[g, 2 * t + e], a[g + 8, 2 * t + e] = a_regs[0][lane, e], a_regs[1][lane, e]
            a[g, 8 + 2 * t + e], a[g + 8, 8 + 2 * t + e] = a_regs[2][lane, e], a_regs[3][lane, e]
            b[2 * t + e, g], b[8 + 2 * t + e, g] = b_regs[0][lane, e], b_regs[1][lane, e]
    return a @ b


def _model_gemv(x, weight, scale_u8, gs, n, act_half=None):
    """gemv_kernel's output before rounding: [M, n] dense (fp32), or with act_half = I (rows 2I, gate then up)
    the pair (gate, up) [M, I] each before its rounding."""
    m = x.shape[0]
    n_pad, k_pad = weight.shape[0], weight.shape[1] * 2
    ch, bt = k_pad // 128, 8 if m <= 8 else 16
    words = weight.view(torch.int32).reshape(-1).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(n_pad // 16, ch, 64, 4)  # uint4 units: 4 a row
    scales = scale_u8.reshape(n_pad // 16, ch, 64, 2).to(torch.int64)  # uint16 units: 4 a row
    scales = scales[..., 0] | (scales[..., 1] << 8)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    so = (t & 1) * 2 + (t >> 1)
    row_blocks = act_half // 8 if act_half else -(-n // 16)
    width = act_half if act_half else n
    out = torch.zeros(2 if act_half else 1, m, width)
    for rb in range(row_blocks):
        r_lo = 8 * rb + g if act_half else 16 * rb + g
        r_hi = act_half + 8 * rb + g if act_half else 16 * rb + g + 8
        acc = torch.zeros(bt // 8, 16, 8)
        for c in range(ch):  # split-K adds its partials in split order: the same sum up to fp32 order
            d = []
            for r in (r_lo, r_hi):
                q = words[r >> 4, c, 4 * (r & 15) + t]  # uint4 4(r & 15) + t: [32, 4] words
                s16 = scales[r >> 4, c, 4 * (r & 15) + so]
                d.append([_model_decode_word(q[:, b], s16) for b in range(4)])
            for j in range(bt // 8):
                tok = (8 * j + g).clamp(max=m - 1)
                base = c * 128 + 16 * t
                for b in range(4):
                    lo, hi = d[0][b], d[1][b]
                    for half, (p0, p1) in ((0, (0, 1)), (64, (2, 3))):
                        k0 = base + half + 4 * b
                        b_regs = [torch.stack([x[tok, k0 + e] for e in range(2)], -1),
                                  torch.stack([x[tok, k0 + 2 + e] for e in range(2)], -1)]  # fmt: skip
                        acc[j] += _mma16816([lo[p0], hi[p0], lo[p1], hi[p1]], b_regs)
        for j in range(bt // 8):
            for h, rows in enumerate((r_lo, r_hi)):
                for e in range(2):
                    ncol = 8 * j + 2 * t + e  # lane (g, t)'s token columns
                    v = acc[j, g + 8 * h, 2 * t + e]
                    gsv = (gs[rows] if gs.numel() > 1 else gs.expand(32)) * 128
                    for i in range(32):
                        if ncol[i] < m and (act_half or rows[i] < n):
                            col = 8 * rb + g[i] if act_half else rows[i]
                            out[h if act_half else 0, ncol[i], col] = v[i] * gsv[i]
    return (out[0], out[1]) if act_half else out[0]


@pytest.mark.parametrize("m, n, k", [(3, 40, 256), (11, 200, 384)])
def test_model_of_the_gemv_indexing_matches_the_reference(m, n, k) -> None:
    """The model of the decode GEMV's layouts against the fp32 reference: the 8- and 16-token tiles (tokens
    past M), N inside a row block, per-row global scales; and the activation's rows: gate row 8rb + g and up
    row I + 8rb + g of the same lane, each equal to its own rows of the reference."""
    from k3run.testing import assert_within

    w, s, gs = _random_nvfp4(n, k, "cpu", True, seed=12)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float()
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x @ wd.t()) * gs.reshape(1, -1)
    bound = 3 * k * 2.0**-24 * ((x.abs() @ wd.abs().t()) * gs) + 1e-30
    got = _model_gemv(x, tw.weight, tw.scale_bits, tw.global_scale, n)
    assert_within(f"gemv model {m}x{n}x{k}", ref, got, bound)
    i = 24  # 2I = 48 rows: 3 row blocks of gate / up pairs, the up half starting inside a 16-row block
    w, s, gs = _random_nvfp4(2 * i, k, "cpu", True, seed=13)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x @ wd.t()) * gs.reshape(1, -1)
    bound = 3 * k * 2.0**-24 * ((x.abs() @ wd.abs().t()) * gs) + 1e-30
    gate, up = _model_gemv(x, tw.weight, tw.scale_bits, tw.global_scale, 2 * i, act_half=i)
    assert_within("gemv model gate rows", ref[:, :i], gate, bound[:, :i])
    assert_within("gemv model up rows", ref[:, i:], up, bound[:, i:])
