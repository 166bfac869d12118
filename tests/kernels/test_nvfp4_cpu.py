"""The fused CPU NVFP4 GEMV (kernels/nvfp4_gemm/cpu.py) against the fp32 reference (dequantize, then matmul).

Error bound: both compute the same exact products (4 * e2m1 codes are small integers, E4M3 scales and the
fp32 inputs are exact in fp32) and differ only in the order of the fp32 sums over K. With the unit-scale
random data here the relative RMS difference is ~sqrt(K) * 2^-24 ~ 4e-6 at K = 4096; bound 1e-5. On too small
a matrix the reference itself runs: bit-equal.
"""

from __future__ import annotations

import pytest
import torch

import k3run.kernels.cpu_simd as cpu_simd
import k3run.kernels.nvfp4_gemm.cpu as cpu
from k3run.formats import E2M1_VALUES, dequantize_nvfp4
from k3run.kernels import cpu_fused
from k3run.kernels.nvfp4_gemm import NvFp4Weight, nvfp4_linear
from k3run.kernels.nvfp4_gemm.ref import nvfp4_linear_ref
from k3run.testing import RTOL, assert_close
from tests.kernels.cpu_paths import needs_cxx, needs_simd
from tests.kernels.test_nvfp4_gemm import _random_nvfp4


def test_codes_decode_to_four_times_e2m1() -> None:
    got = cpu._e2m1_times4(torch.arange(16, dtype=torch.int32))
    assert torch.equal(got, 4 * E2M1_VALUES.float())


@pytest.mark.parametrize("m, n, k", [(1, 37, 160), (3, 64, 4096), (8, 19, 48)])
def test_eager_formula_matches_reference(m: int, n: int, k: int) -> None:
    w, s, gs = _random_nvfp4(n, k, per_row_global=True)
    x = torch.randn(m, k)
    got = cpu.nvfp4_gemv_fused(x[:, 0::2].contiguous(), x[:, 1::2].contiguous(), w, s, gs)
    assert_close("fused formula", nvfp4_linear_ref(x, w, s, gs), got, rtol=RTOL[torch.float32])


def _linear_matches_reference(what: str, shapes: list[tuple[int, int, int]], per_row: bool) -> None:
    """nvfp4_linear_cpu against the reference at each (M, N, K), with a bias, fp32 and bf16 inputs:
    RTOL[torch.float32] for fp32; bf16 outputs round the same fp32 value, one bf16 ulp (2^-8) apart where
    they straddle a tie."""
    for m, n, k in shapes:
        w, s, gs = _random_nvfp4(n, k, per_row_global=per_row)
        bias = torch.randn(n)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            want = nvfp4_linear_ref(x, w, s, gs, bias)
            got = cpu.nvfp4_linear_cpu(x, w, s, gs, bias)
            assert got.dtype == dtype
            rtol = RTOL[torch.float32] if dtype == torch.float32 else 4e-3
            assert_close(f"{what} {m}x{n}x{k} {dtype}", want, got, rtol=rtol)


@needs_simd
@pytest.mark.parametrize("per_row", [False, True])
def test_simd_gemv_matches_reference(monkeypatch, simd_level, per_row: bool) -> None:
    """The SIMD extension (AVX-512 and AVX2): 1..8 rows and 19 (calls of <= 8 / 4 rows), K with a last half
    chunk (K / 2 = 1800 bytes: 8 past a multiple of 16) and without, N not a multiple of the thread grain,
    bf16 and fp32 inputs, a bias; nvfp4_linear_cpu takes it for up to cpu_simd.NVFP4_MAX_M rows on matrices
    of MIN_WEIGHTS and up. Same products as the reference, other sum order (RTOL[torch.float32])."""
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 0)
    assert cpu_simd.available(), cpu_simd._error
    shapes = [(1, 520, 3600), (3, 37, 4096), (8, 129, 48), (5, 16, 32), (19, 40, 272)]
    _linear_matches_reference(simd_level, shapes, per_row)


@needs_simd
def test_simd_bf16_weights_are_exact_in_permuted_order(simd_level) -> None:
    """nvfp4_dequant_bf16_perm: codes times block scales in bf16 bit for bit, each 32-column chunk as its
    even then its odd columns, which nvfp4_x_perm reproduces on any matrix; shapes not a multiple of 32
    refused."""
    assert cpu_simd.available(), cpu_simd._error
    w, s, _ = _random_nvfp4(37, 320)
    got = cpu_simd.nvfp4_dequant_bf16_perm(w, s)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), cpu_simd.nvfp4_x_perm(dequantize_nvfp4(w, s, 1.0)))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_simd.nvfp4_dequant_bf16_perm(*_random_nvfp4(4, 48)[:2])


@needs_simd
@pytest.mark.parametrize("per_row", [False, True])
def test_simd_bf16_prefill_within_one_ulp(monkeypatch, simd_level, per_row: bool) -> None:
    """bf16 inputs above cpu_fused.MAX_M rows with the SIMD extension: exact bf16 weights, a bf16 matmul, then
    the global scale and the bias: the output rounds to bf16 twice (after the matmul, after the scale), so
    each element is within one bf16 ulp (2^-8 relative) of the reference's single rounding; bound 2^-8 on
    the relative RMS. Row blocks of 16 rows (3 blocks and a partial one for N = 56)."""
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(cpu_fused, "DEQUANT_BLOCK_FLOATS", 16 * 640)
    assert cpu_simd.available(), cpu_simd._error
    for m, n, k in [(9, 56, 640), (40, 37, 4096)]:
        w, s, gs = _random_nvfp4(n, k, per_row_global=per_row)
        bias = torch.randn(n)
        x = torch.randn(m, k).bfloat16()
        got = cpu.nvfp4_linear_cpu(x, w, s, gs, bias)
        assert got.dtype == torch.bfloat16
        assert_close(f"bf16 prefill {m}x{n}x{k}", nvfp4_linear_ref(x, w, s, gs, bias), got, rtol=2.0**-8)


@needs_simd
def test_simd_gemv_every_code_and_scale_exact(simd_level) -> None:
    """Each of the 16 codes in both nibbles under every finite E4M3 scale (subnormals and -0 included), read
    back through one-hot inputs: exact (one product per output, no sums)."""
    assert cpu_simd.available(), cpu_simd._error
    scales = torch.arange(0x7F, dtype=torch.uint8)  # 0x00..0x7E: every finite non-negative E4M3 value
    n, k = 16 * scales.numel(), 32
    codes = torch.arange(16, dtype=torch.uint8).repeat(scales.numel())  # row r holds code r % 16
    w = (codes | (codes << 4)).reshape(n, 1).expand(n, k // 2).contiguous()  # both nibbles = the code
    s = scales.repeat_interleave(16).reshape(n, 1).expand(n, k // 16).contiguous().view(torch.float8_e4m3fn)
    gs = torch.tensor([0.75])
    x = torch.zeros(2, k)
    x[0, 2] = 1.0  # an even column: low nibbles
    x[1, 21] = 1.0  # an odd column in the second scale group: high nibbles
    want = nvfp4_linear_ref(x, w, s, gs)
    got = cpu_simd.nvfp4_gemv_simd(x, w, s, gs)
    assert torch.equal(got, want)
    assert torch.equal(got[0], (E2M1_VALUES.float().repeat(scales.numel()) * s[:, 0].float() * 0.75))


@needs_simd
def test_simd_gemv_rejects_bad_operands(simd_level) -> None:
    assert cpu_simd.available(), cpu_simd._error
    w, s, gs = _random_nvfp4(8, 64)
    with pytest.raises(ValueError, match="weight uint8"):
        cpu_simd.nvfp4_gemv_simd(torch.randn(1, 96), w, s, gs)
    with pytest.raises(ValueError, match="weight_scale"):
        cpu_simd.nvfp4_gemv_simd(torch.randn(1, 64), w, s[:, :2], gs)
    with pytest.raises(ValueError, match="rows"):
        cpu_simd.nvfp4_gemv_simd(torch.randn(cpu_simd.NVFP4_MAX_M + 1, 64), w, s, gs)


@needs_cxx
@pytest.mark.parametrize("per_row", [False, True])
def test_compiled_gemv_matches_reference(fused_everywhere, per_row: bool) -> None:
    """The torch.compile'd loop (one dynamic-shape compile) at several shapes and row counts, bf16 and fp32
    inputs, with a bias; nvfp4_linear's CPU branch takes it."""
    _linear_matches_reference("compiled", [(1, 96, 512), (5, 33, 272), (2, 128, 1024)], per_row)
    assert cpu_fused.disabled is None, cpu_fused.disabled
    w, s, gs = _random_nvfp4(40, 256)
    x = torch.randn(2, 3, 256)
    want = nvfp4_linear_ref(x.reshape(6, 256), w, s, gs).reshape(2, 3, 40)
    weight = NvFp4Weight(w, s.view(torch.uint8), gs, 256, "checkpoint")
    assert_close("nvfp4_linear cpu", want, nvfp4_linear(x, weight), RTOL[torch.float32])


@needs_cxx
@pytest.mark.parametrize("per_row", [False, True])
def test_prefill_rows_take_the_compiled_dequantization(fused_everywhere, monkeypatch, per_row: bool) -> None:
    """M > CPU_FUSED_MAX_M: the weight decoded once by the compiled one-pass dequantization (the scale
    products round in another order than the reference's: within an fp32 ulp per weight), in row blocks
    (here 3 of 16 rows, each with its rows' global scales), then fp32 matmuls."""
    monkeypatch.setattr(cpu_fused, "DEQUANT_BLOCK_FLOATS", 16 * 320)
    w, s, gs = _random_nvfp4(48, 320, per_row_global=per_row)
    x = torch.randn(cpu_fused.MAX_M + 3, 320).bfloat16()
    want = nvfp4_linear_ref(x, w, s, gs)
    got = cpu.nvfp4_linear_cpu(x, w, s, gs)
    assert_close("prefill rows", want.float(), got.float(), rtol=4e-3)  # bf16 outputs: one ulp at ties
    wd = cpu.nvfp4_dequantize_fused(w, s, gs)
    # (e2m1 * s) * gs rounds once; (4 e2m1) * (s * gs / 4) at most twice: ~1 fp32 ulp apart
    assert_close("one-pass dequantization", dequantize_nvfp4(w, s, 1.0) * gs.reshape(-1, 1), wd, rtol=1e-6)
    assert cpu_fused.disabled is None, cpu_fused.disabled


def test_small_matrices_take_the_extension_else_the_reference(monkeypatch) -> None:
    """Below cpu_fused.MIN_WEIGHTS (no compile) the SIMD extension still runs where the CPU has it: the
    reference's exact products summed in another order in fp32, so within K u (|x| @ |W|^T) of it (bound
    on the relative RMS: K * 2^-24 at K = 320, with the products' magnitudes no larger than the sum's in
    the mean); without it, the reference itself."""
    w, s, gs = _random_nvfp4(24, 320)
    x = torch.randn(3, 320)
    assert not cpu_fused.applies(24, 320)
    want = nvfp4_linear_ref(x, w, s, gs)
    if cpu_simd.available():
        got = cpu.nvfp4_linear_cpu(x, w, s, gs)
        assert_close("small matrix, extension", want, got, rtol=320 * 2.0**-24 * 4)
        assert torch.equal(got, cpu_simd.nvfp4_gemv_simd(x, w, s, gs))
    monkeypatch.setattr(cpu_simd, "available", lambda: False)
    assert torch.equal(cpu.nvfp4_linear_cpu(x, w, s, gs), want)


@pytest.mark.parametrize("m", [1, 12])
def test_a_failed_compile_falls_back_to_the_reference_for_good(
    fused_everywhere, monkeypatch, caplog, m
) -> None:
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_fused, "_compiled", {})
    monkeypatch.setattr(cpu_fused.torch, "compile", no_compiler)
    w, s, gs = _random_nvfp4(24, 64)
    x, bias = torch.randn(m, 64), torch.randn(24)
    with caplog.at_level("WARNING"):
        got = cpu.nvfp4_linear_cpu(x, w, s, gs, bias)
    assert torch.equal(got, nvfp4_linear_ref(x, w, s, gs, bias))
    assert "no C++ compiler" in (cpu_fused.disabled or "") and "could not be compiled" in caplog.text
    assert not cpu_fused.applies(4096, 4096)  # off for the rest of the process


@needs_cxx
def test_many_layer_shapes_never_fall_back_to_eager(fused_everywhere) -> None:
    """What a model throws at the compiled loops (ten weight shapes held as parameters, one row and several,
    inference-mode inputs and not, weight slices at a storage offset) must not exhaust torch.compile's
    recompile limit: past it the loops would silently run eagerly, materialising [M, N, K/2] temporaries."""
    from torch._dynamo.utils import counters

    counters.clear()
    for n, k in [(32, 128), (48, 256), (64, 512), (80, 128), (96, 384), (112, 640), (128, 256), (144, 768)]:
        w, s, gs = _random_nvfp4(n, k)
        w, s = torch.nn.Parameter(w, requires_grad=False), torch.nn.Parameter(s, requires_grad=False)
        for m in (1, 3, cpu_fused.MAX_M + 2):
            for inference in (False, True):
                with torch.inference_mode(inference):
                    x = torch.randn(m, k)
                    got = cpu.nvfp4_linear_cpu(x, w[16:], s[16:], gs)
                assert_close(
                    f"{n}x{k} m={m}", nvfp4_linear_ref(x, w[16:], s[16:], gs), got, rtol=RTOL[torch.float32]
                )
    limits = [key for key in counters["unimplemented"] if "recompile" in key.lower()]
    assert not limits, limits[0][:300]


def test_cpu_load_prepares_the_extension_only_for_large_quantized_matrices(monkeypatch) -> None:
    """load_model on the CPU builds (or loads) the AVX-512 extension up front when a quantized matrix of at
    least MIN_WEIGHTS weights will use it (NVFP4 codes count two weights per byte), and not otherwise."""
    from k3run.api import _prepare_cpu_kernels

    calls = []
    monkeypatch.setattr(cpu_simd, "available", lambda: calls.append(1) or True)
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 1 << 12)
    small = torch.nn.Module()
    small.register_parameter("weight", torch.nn.Parameter(torch.zeros(32, 32, dtype=torch.uint8), False))
    small.register_parameter("dense", torch.nn.Parameter(torch.zeros(512, 512)))
    _prepare_cpu_kernels(small)
    assert calls == []
    big = torch.nn.Module()
    big.register_parameter("weight", torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.uint8), False))
    _prepare_cpu_kernels(big)  # 64 x 32 bytes = 4096 NVFP4 weights
    assert calls == [1]


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_waited_for(tmp_path, monkeypatch) -> None:
    """A build lock left by a killed build (torch's FileBaton would wait for it forever) is removed once it
    is older than STALE_BUILD_LOCK_S; while a lock is younger (another process may be building) the call
    waits, and returns when that build removes it."""
    import os
    import threading
    import time
    from pathlib import Path

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory("k3run_lock_probe", verbose=False)) / "lock"
    lock.touch()
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (cpu_simd._clear_stale_build_lock("k3run_lock_probe", 0.01), done.set())
    )
    t.start()
    assert not done.wait(0.3)  # a fresh lock: still waiting
    lock.unlink()  # the other build finished
    t.join(5)
    assert done.is_set()
    lock.touch()
    old = time.time() - cpu_simd.STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu_simd._clear_stale_build_lock("k3run_lock_probe")
    assert not lock.exists()
    cpu_simd._clear_stale_build_lock("k3run_lock_probe")  # no lock: nothing to do
