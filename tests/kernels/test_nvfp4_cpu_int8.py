"""The int8-activation NVFP4 CPU kernel (cpu_simd.nvfp4_vnni_gemm, AVX-512 VNNI) against the fp32 reference.

What it computes: x rounded to int8 per 16 columns (codes q, scale a = amax / 127), then per scale group an
exact integer dot product of q with the doubled E2M1 codes, times one fp32 product of the two scales,
accumulated in fp32 over the K / 16 groups and times the global scale. So against the reference applied to
the dequantized activations xq = q * a, the only differences are roundings of fp32 operations: one for each
group's scale product, one per group for the fp32 sum, one for the global scale on the kernel's side; the
reference's matmul sums K products (and xq's own q * a rounds). Per output the bound is
(K + K / 16 + 4) * 2^-24 * sum_k |w_k| |xq_k|. Against the reference on the unrounded x, the activations'
rounding adds at most sum_k |w_k| * (a_g / 2 + a_g * 2^-16) (see test_activation_rounding_bound).
"""

from __future__ import annotations

import pytest
import torch

import k3run.kernels.cpu_simd as cpu_simd
from k3run.formats import dequantize_nvfp4
from k3run.kernels.nvfp4_gemm import nvfp4_linear, prepare_nvfp4_weight
from k3run.kernels.nvfp4_gemm.ref import nvfp4_linear_ref
from k3run.knobs import reset_knobs
from k3run.testing import assert_close
from tests.kernels.cpu_paths import needs_simd
from tests.kernels.test_nvfp4_gemm import _random_nvfp4

EPS = 2.0**-24  # fp32 unit roundoff


@pytest.fixture(params=["vpermb", "vpshufb"])
def vnni(request, monkeypatch):
    """The kernel with each code decoder: vpermb where the CPU has AVX-512 VBMI (it falls back to vpshufb
    without), vpshufb (the decoder of VNNI CPUs without VBMI) everywhere."""
    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    if not cpu_simd.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI (or the extension did not build)")
    monkeypatch.setattr(cpu_simd, "INT8_VBMI", request.param == "vpermb")


def _dequantized(x: torch.Tensor) -> torch.Tensor:
    q, a = cpu_simd.nvfp4_vnni_quant(x)
    m, k = x.shape
    return (q.float().view(m, -1, 16) * a[:, :, None]).view(m, k)


def _check(w, s, gs, x, bias=None) -> torch.Tensor:
    """The kernel against the reference on x's int8 rounding, within the bound of the module docstring."""
    m, k = x.shape
    got = cpu_simd.nvfp4_vnni_gemm(x, cpu_simd.nvfp4_vnni_pack(w, s, gs))
    xq = _dequantized(x)
    want = nvfp4_linear_ref(xq, w, s, gs)
    wd = dequantize_nvfp4(w, s, torch.ones(())) * gs.reshape(-1, 1)
    bound = (k + k // 16 + 4) * EPS * (xq.abs() @ wd.abs().t())
    err = (got - want).abs()
    assert bool((err <= bound).all()), (
        f"max error {err.max():.3e}, bound there {bound.flatten()[err.argmax()]:.3e}"
    )
    return got


@needs_simd
@pytest.mark.parametrize("m, n, k", [(1, 37, 48), (3, 300, 1792), (17, 19, 160), (33, 64, 4096)])
@pytest.mark.parametrize("per_row", [False, True])
def test_kernel_is_the_reference_on_int8_activations(vnni, m, n, k, per_row) -> None:
    """Odd row counts (padded row blocks), K not a multiple of 64, token counts across the 16-token tiles."""
    w, s, gs = _random_nvfp4(n, k, per_row_global=per_row)
    x = torch.randn(m, k) * (1 + 30 * (torch.rand(m, k) > 0.99))  # some outliers
    _check(w, s, gs, x)


@needs_simd
def test_every_code_and_scale_byte(vnni) -> None:
    """Every packed byte (both nibbles, all 16 codes, both signs) and every finite E4M3 scale byte, the
    subnormal scales (1..7) included."""
    n, k = 64, 512
    w = torch.arange(n * k // 2).remainder(256).to(torch.uint8).view(n, k // 2)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    s = finite[torch.arange(n * k // 16) % finite.numel()].view(n, k // 16).view(torch.float8_e4m3fn)
    x = torch.randn(5, k)
    _check(w, s, torch.tensor([0.75]), x)
    negative = (s.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)  # the pack moves signs into the codes
    assert torch.equal(
        cpu_simd.nvfp4_vnni_gemm(x, cpu_simd.nvfp4_vnni_pack(w, negative, torch.tensor([0.75]))),
        -cpu_simd.nvfp4_vnni_gemm(x, cpu_simd.nvfp4_vnni_pack(w, s, torch.tensor([0.75]))),
    )
    with pytest.raises(ValueError, match="NaN"):
        cpu_simd.nvfp4_vnni_pack(
            w, torch.full_like(s.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn), torch.ones(1)
        )


@needs_simd
def test_activation_rounding_bound(vnni) -> None:
    """q = round(x * 127 / amax) per 16 columns: |q| <= 127 with 127 reached in every nonzero group,
    |x - q a| <= a (1/2 + 2^-16); an all-zero group gives codes 0 and scale 0; an inf or NaN poisons its
    group's scale (NaN), so the outputs it touches are NaN, as the reference's would be."""
    x = torch.randn(7, 336) * torch.logspace(-20, 20, 336)
    x[2, 16:32] = 0
    q, a = cpu_simd.nvfp4_vnni_quant(x)
    qf = q.float().view(7, -1, 16)
    assert int(q.abs().max()) <= 127
    nonzero = (x.view(7, -1, 16) != 0).any(-1)
    assert bool((qf.abs().amax(-1)[nonzero] == 127).all())
    assert bool((qf[2, 1] == 0).all()) and float(a[2, 1]) == 0.0
    err = (x.view(7, -1, 16) - qf * a[:, :, None]).abs()
    assert bool((err <= a[:, :, None] * (0.5 + 2.0**-16)).all())
    x[4, 40] = float("inf")
    x[5, 3] = float("nan")
    _, a = cpu_simd.nvfp4_vnni_quant(x)
    assert bool(a[4, 2].isnan()) and bool(a[5, 0].isnan())
    w, s, gs = _random_nvfp4(24, 336)
    y = cpu_simd.nvfp4_vnni_gemm(x, cpu_simd.nvfp4_vnni_pack(w, s, gs))
    assert bool(y[4:6].isnan().all()) and bool(torch.isfinite(y[[0, 1, 2, 3, 6]]).all())


@needs_simd
def test_error_against_the_unrounded_reference(vnni) -> None:
    """The exactness statement on the original x: within the activations' rounding (a_g / 2 per element,
    weighted by |w|) plus the fp32 term. Prints the measured relative error (RMS over outputs / RMS of y)."""
    m, n, k = 4, 256, 2048
    w, s, gs = _random_nvfp4(n, k)
    x = torch.randn(m, k)
    got = cpu_simd.nvfp4_vnni_gemm(x, cpu_simd.nvfp4_vnni_pack(w, s, gs))
    want = nvfp4_linear_ref(x, w, s, gs)
    _, a = cpu_simd.nvfp4_vnni_quant(x)
    wd = (dequantize_nvfp4(w, s, torch.ones(())) * gs).abs()
    step = a.repeat_interleave(16, dim=1) * (0.5 + 2.0**-16)  # [M, K] per element
    bound = step @ wd.t() + (k + k // 16 + 4) * EPS * (x.abs() + step) @ wd.t()
    err = (got - want).abs()
    assert bool((err <= bound).all())
    rel = float(err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    print(f"int8 activations, K={k}: RMS error / RMS output = {rel:.2e}")
    assert rel < 0.01  # unit-normal x: rounding error a / sqrt(12) with a = amax / 127 ~ 1.8 / 127: ~4e-3


@needs_simd
def test_linear_takes_it_only_when_asked(vnni, monkeypatch) -> None:
    """K3RUN_CPU_INT8=1 at load: prepare_nvfp4_weight keeps a copy in the kernel's layout, nvfp4_linear runs
    it at any row count (bias and the output dtype as the reference's epilogue; more than INT8_MAX_M rows in
    calls of that many, the same bits, since each row's activations are rounded on their own); unset, no
    copy and no int8 rounding."""
    w, s, gs = _random_nvfp4(40, 256)
    x = torch.randn(3, 256)
    bias = torch.randn(40)
    monkeypatch.setenv("K3RUN_CPU_INT8", "1")
    reset_knobs()
    pw = prepare_nvfp4_weight(w, s, gs)
    assert pw.cpu_int8 is not None
    direct = cpu_simd.nvfp4_vnni_gemm(x, pw.cpu_int8)
    assert torch.equal(nvfp4_linear(x, pw, bias), direct + bias)
    assert torch.equal(
        nvfp4_linear(x.bfloat16(), pw).float(),
        cpu_simd.nvfp4_vnni_gemm(x.bfloat16(), pw.cpu_int8).bfloat16().float(),
    )
    monkeypatch.setattr(cpu_simd, "INT8_MAX_M", 2)
    # 3 rows in calls of 2 and 1: bit for bit the one call's rows
    assert torch.equal(nvfp4_linear(x, pw, bias), direct + bias)
    monkeypatch.setenv("K3RUN_CPU_INT8", "0")
    reset_knobs()
    exact = prepare_nvfp4_weight(w, s, gs)
    # without the copy: the exact path (the reference's products; fp32 sums in another order: K u relative,
    # x4 margin)
    assert_close("exact path", nvfp4_linear_ref(x, w, s, gs), nvfp4_linear(x, exact), rtol=256 * EPS * 4)
    assert prepare_nvfp4_weight(w, s, gs).cpu_int8 is None
    monkeypatch.setenv("K3RUN_CPU_INT8", "yes")
    reset_knobs()
    with pytest.raises(ValueError, match="K3RUN_CPU_INT8"):
        prepare_nvfp4_weight(w, s, gs)


@needs_simd
def test_bad_operands_name_the_shape(vnni) -> None:
    w, s, gs = _random_nvfp4(16, 64)
    pw = cpu_simd.nvfp4_vnni_pack(w, s, gs)
    with pytest.raises(ValueError, match=r"x \[M, 64\]"):
        cpu_simd.nvfp4_vnni_gemm(torch.randn(2, 48), pw)
    with pytest.raises(ValueError, match="scales"):
        cpu_simd.nvfp4_vnni_pack(w, s[:, :2], gs)


@needs_simd
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_experts_repacked_in_place_run_the_int8_kernel(vnni, monkeypatch, act_name) -> None:
    """K3RUN_CPU_INT8=1 at load: NVFP4 experts on the CPU kernels are repacked in place (no second copy),
    their checkpoint tensors read back unchanged, and fused_experts equals the exact kernel path within the
    activations' int8 rounding (each GEMM's inputs rounded to a / 2 per element: a relative error of ~4e-3
    for these unit-scale rows, bounded here at 2^-5 of the output's largest magnitude; a wrong layout is off
    by O(1))."""
    from k3run.layers.moe import fused_experts
    from tests.layers.test_moe import _kernel_case

    exact, x, ids, weights = _kernel_case(act_name, "cpu", kernels=True, d=256, i=128, tokens=7)
    want = fused_experts(exact, x, ids, weights)
    monkeypatch.setenv("K3RUN_CPU_INT8", "1")
    reset_knobs()
    ex, _, _, _ = _kernel_case(act_name, "cpu", kernels=True, d=256, i=128, tokens=7)
    assert ex.scheme.cpu_int8 is not None
    for e in range(ex.num_local):
        for a, b in zip(ex.scheme.expert_tensors(ex, e), exact.scheme.expert_tensors(exact, e), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # ModelOpt's scales are positive
    got = fused_experts(ex, x, ids, weights)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 2**-5, err
    # the grouped int8 calls equal the per-expert loop over the int8 kernel bit for bit
    assert torch.equal(got, fused_experts(ex, x, ids, weights, grouped=False))
    ids[:3] = ids[0, 0]  # several tokens on one expert (a 16-token tile shared), others unhit
    assert torch.equal(fused_experts(ex, x, ids, weights), fused_experts(ex, x, ids, weights, grouped=False))
    assert not bool(fused_experts(ex, x, ids + ex.num_local, weights).any())  # every pick another rank's


@needs_simd
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 20])
def test_row_block_pairs_give_the_same_bits(vnni, monkeypatch, m) -> None:
    """Two row blocks per pass (2-4 tokens) against one per pass: every output bit equal, with an odd
    block count (the last block alone) and in the grouped call."""
    w, s, gs = _random_nvfp4(16 * 7 - 5, 272, per_row_global=True)
    packed = cpu_simd.nvfp4_vnni_pack(w, s, gs)
    x = torch.randn(m, 272)
    monkeypatch.setattr(cpu_simd, "INT8_PAIRS", True)
    paired = cpu_simd.nvfp4_vnni_gemm(x, packed)
    monkeypatch.setattr(cpu_simd, "INT8_PAIRS", False)
    single = cpu_simd.nvfp4_vnni_gemm(x, packed)
    assert torch.equal(paired, single)
    _check(w, s, gs, x)


@needs_simd
def test_grouped_call_on_gathered_rows_equals_the_gathered_input(vnni) -> None:
    """nvfp4_vnni_grouped(x, rows=r): each of x's rows rounded once, then gathered, gives the bits of
    passing x[r] itself (odd sizes, rows repeated and unused, experts with no rows); a row index out of
    range is refused."""
    g = torch.Generator().manual_seed(3)
    e_count, n, k = 3, 16 * 3 - 7, 80
    packed = [cpu_simd.nvfp4_vnni_pack(*_random_nvfp4(n, k)) for _ in range(e_count)]
    w = torch.stack([p.weight for p in packed])
    s = torch.stack([p.scale for p in packed])
    gs = torch.stack([p.global_scale for p in packed])
    x = torch.randn(9, k, generator=g)
    rows = torch.tensor([4, 4, 0, 8, 1, 4, 6, 6, 2, 0, 8])  # row 3, 5, 7 unused; 4 three times
    offsets = torch.tensor([0, 5, 5, 11])  # expert 1 has no rows
    got = cpu_simd.nvfp4_vnni_grouped(x, w, s, gs, offsets, n, rows=rows)
    assert torch.equal(got, cpu_simd.nvfp4_vnni_grouped(x[rows], w, s, gs, offsets, n))
    with pytest.raises(RuntimeError, match="rows must index"):
        cpu_simd.nvfp4_vnni_grouped(x, w, s, gs, offsets, n, rows=rows + 1)


@needs_simd
def test_chunked_call_gives_the_bits_of_one_pass(vnni, monkeypatch) -> None:
    """nvfp4_vnni_gemm takes INT8_MAX_M rows at a time inside one call (the L2 holds a chunk's activations):
    a 23-row input in chunks of 7 (the last one short) gives every bit of the one-pass call."""
    w, s, gs = _random_nvfp4(16 * 5 - 3, 96)
    packed = cpu_simd.nvfp4_vnni_pack(w, s, gs)
    x = torch.randn(23, 96)
    one = cpu_simd.nvfp4_vnni_gemm(x, packed)
    monkeypatch.setattr(cpu_simd, "INT8_MAX_M", 7)
    assert torch.equal(cpu_simd.nvfp4_vnni_gemm(x, packed), one)


@needs_simd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_moe_combine_is_index_add_bit_for_bit(dtype) -> None:
    """cpu_simd.moe_combine (the routed experts' weighted sum in one pass) against index_add_ of the
    rounded, weighted rows: every bit equal, tokens repeated in any order, some never hit, odd widths."""
    g = torch.Generator().manual_seed(9)
    t, p, d = 7, 23, 301
    out = torch.randn(t, d, generator=g)
    y = torch.randn(p, d, generator=g) * 3
    tok = torch.randint(0, t - 2, (p,), generator=g)  # the last two tokens get nothing
    w = torch.rand(p, generator=g)
    want = out.clone().index_add_(0, tok, y.to(dtype).float() * w[:, None])
    cpu_simd.moe_combine(out, y, tok, w, dtype)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="is not a row of out"):
        cpu_simd.moe_combine(out, y, tok + t, w, dtype)
