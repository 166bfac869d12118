"""NVFP4 W4A16 linear: Triton kernels (interpreter on CPU, compiled on GPU) against the fp32 reference.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules.
"""

from __future__ import annotations

import pytest
import torch

from k3run.formats import dequantize_nvfp4, quantize_nvfp4
from k3run.kernels.nvfp4_gemm import (
    GemmConfig,
    choose_config,
    nvfp4_linear,
    nvfp4_linear_ref,
    nvfp4_to_fp8_block,
    one_wave_split,
    prepare_nvfp4_weight,
    programs_per_sm,
    repack_split128,
    unpack_split128,
)
from k3run.testing import RTOL, assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp16 output: 11 significant bits, one final rounding <= 2^-11 relative per element; the decoded weights are
# exact and the fp32 accumulation adds ~1e-7, so the relative RMS error stays below 2^-11 ~ 4.9e-4.
# bf16 output: 8 significant bits, one final rounding <= 2^-9 relative; the dequantize + cuBLAS path adds
# one more bf16 rounding of every weight (global scale folded in), averaging out across K: bound 2^-8.
# fp32 with IEEE dot: only fp32 summation-order differences (~K * 2^-24)


def _random_nvfp4(n: int, k: int, device: str = "cpu", per_row_global: bool = False):
    """A realistic NVFP4 weight: a random normal matrix (with outlier rows) through the ModelOpt quantizer."""
    w = torch.randn(n, k, device=device) * (1.0 + 4.0 * (torch.rand(n, 1, device=device) > 0.8))
    q = quantize_nvfp4(w)
    gs = q.weight_scale_2.reshape(1).float()
    if per_row_global:
        gs = gs * (0.5 + torch.rand(n, device=device))
    return q.weight, q.weight_scale, gs


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1 (about 10 s, mostly imports)."""
    run_interp_tests_in_child(__file__, expected_passed=8)


@interp_only
@pytest.mark.parametrize("split_k", [1, 2])
def test_interp_gemm_fp16_odd_shape(poison_empty, split_k: int):
    from k3run.kernels.nvfp4_gemm.triton import nvfp4_gemm

    m, n, k = 5, 40, 208  # K pads to 256 (two split128 chunks), N not a multiple of block_n, M < block_m
    w, s, gs = _random_nvfp4(n, k)
    x = torch.randn(m, k).half()
    pw = prepare_nvfp4_weight(w, s, gs, layout="split128")
    y = nvfp4_gemm(
        x,
        pw.weight,
        pw.scale_bits,
        pw.global_scale,
        block_m=16,
        block_n=16,
        block_k=128,
        split_k=split_k,
    )
    assert y.dtype == torch.float16
    assert_close("nvfp4_gemm fp16", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=RTOL[torch.float16])


@interp_only
def test_interp_gemm_fp32_per_row_scale_bias(poison_empty):
    from k3run.kernels.nvfp4_gemm.triton import nvfp4_gemm

    m, n, k = 17, 23, 256  # two M tiles, a partial N tile, K split over two programs
    w, s, gs = _random_nvfp4(n, k, per_row_global=True)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    pw = prepare_nvfp4_weight(w, s, gs, layout="split128")
    y = nvfp4_gemm(
        x,
        pw.weight,
        pw.scale_bits,
        pw.global_scale,
        bias,
        block_m=16,
        block_n=16,
        block_k=128,
        group_m=2,
        split_k=2,
    )
    assert_close("nvfp4_gemm fp32 per-row", nvfp4_linear_ref(x, w, s, gs, bias), y, rtol=RTOL[torch.float32])


@interp_only
@pytest.mark.parametrize("layout", ["split128", "tiled128"])
@pytest.mark.parametrize("k", [512, 80])
def test_interp_dequantize_every_code_exact(poison_empty, k: int, layout: str):
    """All 256 byte values against a spread of E4M3 scales (subnormal ones too): bit-exact with formats, from
    both CUDA layouts (tiled128: 19 rows padded to 32, a per-row global scale padded with ones)."""
    from k3run.kernels.nvfp4_gemm.triton import nvfp4_dequantize

    n = 19
    w = torch.randperm(256).repeat(n, 2)[:, : k // 2].to(torch.uint8)
    w = w[torch.randperm(n)].contiguous()
    exps = torch.randint(-9, 9, (n, k // 16)).float()
    s = (2.0**exps * (1 + torch.rand(n, k // 16))).to(torch.float8_e4m3fn)
    gs = torch.tensor([0.0123]) if layout == "split128" else 0.01 + torch.rand(n)
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    rows = n if layout == "tiled128" else None
    out = nvfp4_dequantize(pw.weight, pw.scale_bits, pw.global_scale, k, torch.float32, block_n=16, rows=rows)
    ref = dequantize_nvfp4(w, s, 1.0) * gs.reshape(-1, 1)
    assert torch.equal(out, ref)
    out16 = nvfp4_dequantize(
        pw.weight, pw.scale_bits, pw.global_scale, k, torch.float16, block_n=16, rows=rows
    )
    assert torch.equal(out16, ref.half())


@interp_only
def test_interp_dequantize_row_chunks_of_a_tiled_weight(poison_empty):
    """What dequant_mm_chunked relies on: a tiled128 weight's rows [r0, r1) (r0 a multiple of 16) are the
    slices [r0, r1 rounded up to 16) of its codes, scales and per-row global scale, and dequantizing them into
    `out` gives exactly those rows of the whole weight's dequantization (53 rows: the last chunk padded)."""
    from k3run.kernels.nvfp4_gemm.dequant_mm import chunk_rows
    from k3run.kernels.nvfp4_gemm.triton import nvfp4_dequantize

    n, k = 53, 272
    w, s, gs = _random_nvfp4(n, k, per_row_global=True)
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    whole = nvfp4_dequantize(pw.weight, pw.scale_bits, pw.global_scale, k, torch.bfloat16, rows=n)
    for r0, r1 in chunk_rows(n, 3):
        r1p = r0 + -(-(r1 - r0) // 16) * 16
        out = torch.full((r1 - r0, k), float("nan"), dtype=torch.bfloat16)
        got = nvfp4_dequantize(
            pw.weight[r0:r1p], pw.scale_bits[r0:r1p], pw.global_scale[r0:r1p], k, torch.bfloat16,
            rows=r1 - r0, out=out,
        )  # fmt: skip
        assert got is out and torch.equal(out, whole[r0:r1]), (r0, r1)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        bad = whole[:, :16]
        nvfp4_dequantize(pw.weight, pw.scale_bits, pw.global_scale, k, torch.bfloat16, rows=n, out=bad)


def test_chunk_rows_cover_the_rows_in_16_row_blocks():
    from k3run.kernels.nvfp4_gemm.dequant_mm import chunk_rows

    for n, chunks in [(12288, 4), (7168, 3), (53, 3), (53, 8), (16, 5), (1, 1), (1000, 7)]:
        b = chunk_rows(n, chunks)
        assert b[0][0] == 0 and b[-1][1] == n and len(b) <= chunks
        assert all(r1 == r0n for (_, r1), (r0n, _) in zip(b, b[1:], strict=False))
        assert all(r0 % 16 == 0 and r1 > r0 for r0, r1 in b)
    assert chunk_rows(12288, 4) == [(0, 3072), (3072, 6144), (6144, 9216), (9216, 12288)]
    with pytest.raises(ValueError, match="chunks=0"):
        chunk_rows(16, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunks", [2, 3, 5])
@pytest.mark.parametrize("per_row", [False, True])
def test_gpu_dequant_mm_in_chunks_equals_one_product(poison_empty, chunks: int, per_row: bool):
    """K3RUN_DEQUANT_CHUNKS: the weight dequantized in row chunks on a side stream, each chunk's product into
    its columns of y, against the one-chunk path (same dequantized rows: they agree within one bf16 rounding
    of the output, cuBLAS's kernel for the narrower product may sum in another order) and the fp32
    reference; eagerly and replayed from a CUDA graph."""
    from k3run.knobs import override_knobs

    n, k, m = 1000 + 4, 1392, 300
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=per_row)
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    cfg = GemmConfig(dequant_mm=True)
    want = nvfp4_linear(x, pw, bias, config=cfg)
    with override_knobs(dequant_chunks=chunks):
        got = nvfp4_linear(x, pw, bias, config=cfg)
        assert_close("chunked vs one product", want.float(), got, rtol=RTOL[torch.bfloat16])
        assert_close("chunked vs fp32", nvfp4_linear_ref(x.float(), w, s, gs, bias.float()), got,
                     rtol=RTOL[torch.bfloat16])  # fmt: skip
        nvfp4_linear(x, pw, None, config=cfg)  # warm-up off the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = nvfp4_linear(x, pw, None, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, nvfp4_linear(x, pw, None, config=cfg))


@pytest.mark.parametrize("n, k", [(19, 80), (32, 1392), (1, 16)])
def test_tiled128_prepare_round_trip(n: int, k: int):
    """tiled128 pads rows to 16 (zeros), keeps N in `rows`, pads a per-row global scale with ones, stores each
    tile contiguously with each word's bits placed for the shift decoder (TILED_PAIR_BITS), and
    checkpoint_tensors gives the inputs back (nonzero scales: zero-scale groups are the next test)."""
    from k3run.kernels.nvfp4_gemm import TILED_SCALE_ORDER, tiled_word

    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s = torch.randint(1, 0x7F, (n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    gs = torch.rand(n) + 0.5
    pw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    n_pad, k_pad = -(-n // 16) * 16, -(-k // 128) * 128
    assert (
        pw.n == n and pw.weight.shape == (n_pad, k_pad // 2) and pw.scale_bits.shape == (n_pad, k_pad // 16)
    )
    assert torch.equal(pw.global_scale[:n], gs) and bool((pw.global_scale[n:] == 1).all())
    w2, s2 = pw.checkpoint_tensors()
    assert torch.equal(w2, w) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    split, sbits = repack_split128(w, s)
    r, c, word = n - 1, k_pad // 128 - 1, 1  # one word by hand: tile (r // 16, c), row r % 16, word 1
    tile = (r // 16) * (k_pad // 128) + c
    stored = pw.weight.view(-1)[tile * 1024 + (r % 16) * 64 + 4 * word :][:4].tolist()
    logical = split[r, c * 64 + 4 * word :][:4].tolist()
    assert sum(v << (8 * i) for i, v in enumerate(stored)) == tiled_word(logical)
    order = [c * 8 + g for g in TILED_SCALE_ORDER]  # (low 0, high 0, low 2, high 2, low 1, high 1, ...)
    assert torch.equal(pw.scale_bits.view(-1)[tile * 128 + (r % 16) * 8 :][:8], sbits[r, order])
    x = torch.randn(3, k)  # the CPU path reads it through checkpoint_tensors
    assert_close("tiled128 cpu", nvfp4_linear_ref(x, w, s, gs), nvfp4_linear(x, pw), rtol=RTOL[torch.float32])


def test_tiled128_zero_scale_groups_and_bad_scales():
    """A group whose scale is 0 is stored with zero codes (the shift decoder's scale is 2^104, not 0, there):
    the dequantized weight is unchanged. Negative and NaN E4M3 scales are refused, naming the tensor."""
    n, k = 16, 256
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8)
    s[3, 5] = 0  # and random zeros elsewhere
    pw = prepare_nvfp4_weight(w, s.view(torch.float8_e4m3fn), torch.ones(1), layout="tiled128")
    w2, s2 = pw.checkpoint_tensors()
    assert torch.equal(s2.view(torch.uint8), s)
    assert torch.equal(dequantize_nvfp4(w2, s2, 1.0), dequantize_nvfp4(w, s.view(torch.float8_e4m3fn), 1.0))
    zero = (s == 0).repeat_interleave(8, dim=1)  # 8 bytes (16 codes) per group
    assert bool((w2[zero] == 0).all()) and torch.equal(w2[~zero], w[~zero])
    for byte in (0x81, 0x7F, 0xFF):
        bad = s.clone()
        bad[2, 9] = byte
        with pytest.raises(ValueError, match=r"weight_scale: expected finite E4M3 scales >= 0.*\(2, 9\)"):
            prepare_nvfp4_weight(w, bad.view(torch.float8_e4m3fn), torch.ones(1), layout="tiled128")


@pytest.mark.parametrize("k", [16, 80, 128, 1392])
def test_split128_round_trip(k: int):
    n = 7
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    packed, sbits = repack_split128(w, s)
    k_pad = -(-k // 128) * 128
    assert packed.shape == (n, k_pad // 2) and sbits.shape == (n, k_pad // 16)
    w2, s2 = unpack_split128(packed, sbits, k)
    assert torch.equal(w2, w) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    # byte j of chunk c holds k = 128 c + j (low nibble) and 128 c + 64 + j (high nibble)
    codes = torch.stack([w & 0xF, w >> 4], -1).reshape(n, k)
    if k >= 128:
        assert torch.equal(packed[:, 5] & 0xF, codes[:, 5]) and torch.equal(packed[:, 5] >> 4, codes[:, 69])


@pytest.mark.parametrize("layout", ["checkpoint", "split128"])
def test_cpu_linear_matches_reference_with_leading_dims(layout: str):
    n, k = 24, 80
    w, s, gs = _random_nvfp4(n, k)
    pw = prepare_nvfp4_weight(w, s, gs.reshape(()), layout=layout)
    assert pw.layout == layout and pw.k == k and pw.n == n
    x = torch.randn(2, 3, k)
    y = nvfp4_linear(x, pw)
    assert y.shape == (2, 3, n)
    ref = x.reshape(6, k) @ dequantize_nvfp4(w, s, gs.reshape(())).t()
    assert_close("cpu nvfp4_linear", ref.reshape(2, 3, n), y, rtol=1e-6)


def test_prepare_rejects_bad_tensors():
    w, s, gs = _random_nvfp4(16, 64)
    with pytest.raises(ValueError, match="weight_scale: expected float8_e4m3fn"):
        prepare_nvfp4_weight(w, s.float(), gs)
    with pytest.raises(ValueError, match=r"weight_scale: expected .*\(16, 4\)"):
        prepare_nvfp4_weight(w, s[:, :2], gs)
    with pytest.raises(ValueError, match="multiple of 16"):
        prepare_nvfp4_weight(w[:, :4], s[:, :1], gs)
    with pytest.raises(ValueError, match="weight_scale_2"):
        prepare_nvfp4_weight(w, s, torch.ones(3))
    with pytest.raises(ValueError, match="input has K=32"):
        nvfp4_linear(torch.randn(2, 32), prepare_nvfp4_weight(w, s, gs))
    with pytest.raises(ValueError, match="layout"):
        prepare_nvfp4_weight(w, s, gs, layout="marlin")


def test_nvfp4_to_fp8_block_error_is_one_e4m3_rounding():
    """The FP8 conversion re-rounds every weight once to E4M3 in its 128x128 block: relative error per
    element <= 2^-4 for normal values (3 mantissa bits), so the RMS error stays well under 2^-4."""
    from k3run.formats import dequantize_fp8_block

    n, k = 200, 256
    w, s, gs = _random_nvfp4(n, k, per_row_global=True)
    q, scale = nvfp4_to_fp8_block(w, s, gs)
    assert q.shape == (256, k) and scale.shape == (2, 2) and torch.count_nonzero(q[n:].float()) == 0
    exact = dequantize_nvfp4(w, s, torch.ones(())) * gs.reshape(-1, 1)
    assert_close("nvfp4 -> fp8 block", exact, dequantize_fp8_block(q, scale)[:n], rtol=2.0**-4)
    with pytest.raises(ValueError, match="multiple of 128"):
        nvfp4_to_fp8_block(*_random_nvfp4(8, 80))


def test_choose_config_covers_decode_and_prefill():
    """M <= 32: the Gluon decode kernel's cp.async variant (1-warp programs, 2 stages; split_k for M <= 16 by
    one_wave_split on 132 SMs, 2 or 4 for M <= 64); 33..64 on large matrices too; larger M: dequantize +
    cuBLAS (H200 measurements: bench/RESULTS.md). K = 7168: 56 chunks of 128 (divisors 1 2 4 7 8 14 ...)."""
    cases = [
        (1, 7168, 8, None),
        (8, 12288, 4, None),
        (16, 7168, 7, 80),
        (16, 12288, 4, 80),
        (9, 3072, 8, None),
    ]
    cases += [(16, 200_000, 1, None), (17, 7168, 2, None), (32, 12288, 2, None), (24, 3584, 4, None)]
    for m, n, split_k, maxnreg in cases:
        cfg = choose_config(m, n, 7168)
        got = (cfg.gemv, cfg.num_warps, cfg.split_k, cfg.smem_stages, cfg.maxnreg)
        assert got == (True, 1, split_k, 2, maxnreg), (m, n, got)
    # 33..64 rows: two launches of the 32-row tile on large matrices, the tile GEMM on small ones
    for m, n, k, split_k in [(33, 7168, 7168, 2), (64, 12288, 7168, 2), (64, 3072, 12288, 4)]:
        cfg = choose_config(m, n, k)
        assert (cfg.gemv, cfg.split_k, cfg.smem_stages) == (True, split_k, 2), (m, n, k, cfg)
    assert choose_config(64, 3072, 3584).tile and not choose_config(64, 3072, 3584).gemv
    assert choose_config(65, 7168, 7168).tile and choose_config(128, 7168, 7168).tile
    assert choose_config(129, 7168, 7168).dequant_mm and choose_config(4096, 7168, 7168).dequant_mm


def test_one_wave_split_keeps_every_program_resident():
    """Programs per SM from the register file (4 schedulers x 16384 registers, whole warps, 8 registers per
    thread at a time; at most 32 blocks): the H200 held 32 / 24 / 20 programs at 64 / 80 / ~90 registers.
    The split is the largest divisor (<= 8) of the chunk count whose grid fits at once; the 16-token tile
    takes the 80-register cap only where that admits a larger split."""
    assert [programs_per_sm(r) for r in (64, 72, 80, 88, 90, 128)] == [32, 28, 24, 20, 20, 16]
    for sms in (132, 114, 78):
        for m in (1, 8, 9, 16):
            for n, k in [(7168, 7168), (12288, 7168), (7168, 12288), (3072, 3584), (3584, 3072), (520, 3600)]:
                split, maxnreg = one_wave_split(m, n, k, sms)
                chunks, blocks = -(-k // 128), -(-n // 16)
                regs = 64 if m <= 8 else maxnreg or 90
                assert chunks % split == 0 and 1 <= split <= 8
                assert split == 1 or blocks * split <= sms * programs_per_sm(regs), (m, n, k, sms, split)
                bigger = [d for d in range(split + 1, 9) if chunks % d == 0]
                best = sms * programs_per_sm(64 if m <= 8 else 80)
                assert all(blocks * d > best for d in bigger), (m, n, k, sms, split, bigger)
    assert one_wave_split(16, 7168, 12288, 132) == (6, 80)  # 448 blocks: 20 x 132 admits 4, 24 x 132 admits 6
    assert one_wave_split(16, 3072, 3584, 132) == (7, None)  # fits at the uncapped 20 per SM already
    # more rows than one wave holds unsplit (16 picks of a 6144-row expert GEMM): 6144 blocks on 4224 slots
    # fill 1.45 waves unsplit (73% of two), 2.91 at split_k 2 (97% of three): 2
    assert one_wave_split(1, 16 * 6144, 3584, 132) == (2, None)
    assert one_wave_split(1, 64 * 6144, 3584, 132) == (1, None)  # 5.8 waves unsplit: 97% already
    # the 32-token tile (141 registers: 12 programs per SM), never capped: 448 blocks on 1584 slots admit 3 of
    # 12288 / 128 = 96 chunks' divisors (4 would need 1792 slots)
    assert programs_per_sm(141) == 12
    assert one_wave_split(32, 7168, 12288, 132) == (3, None)
    assert one_wave_split(17, 7168, 12288, 132) == (3, None)


def test_t32_form_knob_shapes_the_17_to_32_row_launches_and_sizes_their_split():
    """K3RUN_GEMV_T32_FORM: dense launches of 17..32 rows take the form's row warps and token warps, 1..16
    rows never; the split counts the form's programs that fit an SM (its GEMV_T32_FORMS registers and
    warps) over its row blocks (16 rows a row warp); a malformed value names the variable."""
    from k3run.kernels.nvfp4_gemm.config import GEMV_T32_FORMS, tile32_split
    from k3run.knobs import Knobs, override_knobs

    # 2 token warps at 88 registers: 20 warps an SM, 10 programs; 4 token warps at 62: 32 warps, 8 programs;
    # 4 row warps x 2 token warps at 90: 16 warps, 2 programs
    assert programs_per_sm(GEMV_T32_FORMS[1, 2], 2) == 10
    assert programs_per_sm(GEMV_T32_FORMS[1, 4], 4) == 8
    assert programs_per_sm(GEMV_T32_FORMS[4, 2], 8) == 2
    with override_knobs(gemv_t32_form="1/1"):
        base = {m: choose_config(m, 2304, 1024) for m in (1, 8, 16, 17, 32)}
    assert {(c.num_warps, c.token_warps) for c in base.values()} == {(1, 1)}
    for form, want in (("1/2", (1, 2)), ("4/1", (4, 1)), ("2/4", (2, 4))):
        with override_knobs(gemv_t32_form=form):
            got = {m: choose_config(m, 2304, 1024) for m in (1, 8, 16, 17, 32)}
        assert all(got[m] == base[m] for m in (1, 8, 16))
        assert all((got[m].num_warps, got[m].token_warps) == want for m in (17, 32))
    # 2304 x 4096 (32 chunks): on 40 SMs 144 one-row-warp blocks, 40 x 12 // 144 = 3 one-warp programs a
    # block fit (split 2), 40 x 10 // 144 = 2 two-token-warp ones (2); 4 row warps x 2: 36 blocks,
    # 40 x 2 // 36 = 2 (split 2); on 132 SMs 132 x 10 // 144 = 9 -> 8
    assert tile32_split(2304, 4096, 40) == 2 and tile32_split(2304, 4096, 40, (1, 2)) == 2
    assert tile32_split(2304, 4096, 40, (4, 2)) == 2
    assert tile32_split(2304, 4096, 132, (1, 2)) == 8
    for bad in ("3/1", "1/1/x", "4/4", "2"):
        with pytest.raises(ValueError, match="K3RUN_GEMV_T32_FORM"):
            Knobs.from_env({"K3RUN_GEMV_T32_FORM": bad})


def test_tile32_split_on_small_k_fits_one_wave_with_three_chunks_a_program():
    """17..32 rows, K <= 4096: the largest divisor (<= 8) of the chunk count whose grid fits at once (12
    programs an SM) and leaves every program >= 3 chunks; on Kimi Linear's shapes the H100's fastest splits
    of run 218. K > 4096 keeps K3's measured 2 / 4."""
    from k3run.kernels.nvfp4_gemm.config import tile32_split

    kimi = {(12448, 2304): 2, (6144, 2304): 3, (2048, 2304): 6, (576, 2304): 6, (128, 2304): 6,
            (2304, 1024): 2, (2304, 4096): 8, (4096, 128): 1}  # fmt: skip
    assert {nk: tile32_split(*nk) for nk in kimi} == kimi
    assert [choose_config(m, 2304, 1024).split_k for m in (16, 17, 32)] == [8, 2, 2]
    assert (tile32_split(7168, 7168), tile32_split(12288, 7168), tile32_split(3584, 7168)) == (2, 2, 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 40000, (1,), generator=gen))
        k = int(torch.randint(1, 4097, (1,), generator=gen))
        sms = int(torch.randint(16, 170, (1,), generator=gen))
        split = tile32_split(n, k, sms)
        chunks, blocks = -(-k // 128), -(-n // 16)
        assert 1 <= split <= 8 and chunks % split == 0, (n, k, sms, split)
        if split > 1:
            assert chunks // split >= 3 and blocks * split <= sms * programs_per_sm(141), (n, k, sms, split)
        bigger = [d for d in range(split + 1, 9) if chunks % d == 0]
        assert all(chunks // d < 3 or blocks * d > sms * programs_per_sm(141) for d in bigger)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 40])
def test_gpu_gemv_config_falls_back_for_fp32(poison_empty, m: int):
    """A gemv config with fp32 input (the Gluon kernel takes bf16/fp16 only) runs the Triton kernels."""
    n, k = 72, 400
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="split128")
    x = torch.randn(m, k, device="cuda")
    y = nvfp4_linear(x, pw, config=GemmConfig(gemv=True))
    # a tiled128 weight (the default where the cp.async kernel runs) falls back to dequantize + cuBLAS
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    assert_close(
        "tiled fallback fp32", nvfp4_linear_ref(x, w, s, gs), nvfp4_linear(x, tw), rtol=RTOL[torch.float32]
    )
    assert_close("gemv fallback fp32", nvfp4_linear_ref(x, w, s, gs), y, rtol=RTOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 24, 37, 300, 1500])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("layout", [None, "split128"])
def test_gpu_linear_bf16(poison_empty, m: int, per_row: bool, layout: str | None):
    """Every path choose_config picks, on the default CUDA layout (tiled128 on sm_89+) and on split128."""
    n, k = 1000 + 4, 1392  # N not a multiple of 16 (tiled128 pads it), K an odd multiple of 16
    w, s, gs = _random_nvfp4(n, k, device="cuda", per_row_global=per_row)
    pw = prepare_nvfp4_weight(w, s, gs, layout=layout)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    y = nvfp4_linear(x, pw, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert_close(
        f"nvfp4_linear m={m}",
        nvfp4_linear_ref(x.float(), w, s, gs, bias.float()),
        y,
        rtol=RTOL[torch.bfloat16],
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(),
        GemmConfig(decode=0),
        GemmConfig(block_n=128, block_k=512, num_stages=3),
        GemmConfig(block_n=16, split_k=4),
        GemmConfig(block_n=64, split_k=3, decode=0),
        GemmConfig(block_m=64, block_n=64, block_k=128),
        GemmConfig(block_m=64, block_n=64, block_k=128, decode=0),
        GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
        GemmConfig(dequant_mm=True),
    ],
)
def test_gpu_every_path_fp16(poison_empty, cfg: GemmConfig):
    n, k = 520, 3600  # K pads to 3712: the last split128 chunk is partial
    w, s, gs = _random_nvfp4(n, k, device="cuda")
    pw = prepare_nvfp4_weight(w, s, gs, layout="split128")  # the Triton kernels read split128
    x = torch.randn(33, k, device="cuda").half()
    y = nvfp4_linear(x, pw, config=cfg)
    rtol = (
        2.0**-10 if cfg.dequant_mm else RTOL[torch.float16]
    )  # dequant path: one more fp16 rounding per weight
    assert_close(f"nvfp4 {cfg}", nvfp4_linear_ref(x.float(), w, s, gs), y, rtol=rtol)


def _emulate_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """A tiny interpreter for the integer PTX of the decoder (mov/and/or/shl/shr/prmt; mul by torch)."""

    def val(a: str) -> int:
        return regs[a] if a in regs else int(a, 0)

    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), "the decoder is one PTX block"
    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and "{" in rest:  # pack / unpack 16-bit halves: {lo, hi}
            left = [x.strip() for x in rest.split("}", 1)[0].split("{", 1)[1].split(",")]
            if rest.lstrip().startswith("{"):  # mov.b32 {a, b}, r
                src = val(rest.rsplit(",", 1)[1].strip())
                lo, hi = left
                regs[lo], regs[hi] = src & 0xFFFF, src >> 16
            else:  # mov.b32 d, {a, b}
                d = rest.split(",", 1)[0].strip()
                lo, hi = left
                regs[d] = val(lo) | (val(hi) << 16)
            continue
        d, *a = [x.strip() for x in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "lop3.b32":
            x, y, z, lut = (val(v) for v in a)
            out = 0
            for bit in range(32):
                idx = ((x >> bit) & 1) << 2 | ((y >> bit) & 1) << 1 | ((z >> bit) & 1)
                out |= ((lut >> idx) & 1) << bit
            regs[d] = out
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1])
        elif op == "or.b32":
            regs[d] = val(a[0]) | val(a[1])
        elif op == "shl.b32":
            regs[d] = (val(a[0]) << val(a[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op == "add.u32":
            regs[d] = (val(a[0]) + val(a[1])) & 0xFFFFFFFF
        elif op == "prmt.b32":
            src = val(a[0]) | (val(a[1]) << 32)
            out = 0
            for i in range(4):
                sel = (val(a[2]) >> (4 * i)) & 0xF
                byte = (src >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
            regs[d] = out
        elif (
            op == "cvt.rn.f16x2.e4m3x2"
        ):  # two E4M3 bytes of a 16-bit operand -> f16x2 (low byte -> low half)
            src = val(a[0])
            f8 = torch.tensor([src & 0xFF, (src >> 8) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
            h = f8.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[d] = int(h[0]) | (int(h[1]) << 16)
        elif op.startswith("mul.rn."):
            dt = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            x, y = (
                torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16) for v in map(val, a)
            )
            prod = (x.view(dt) * y.view(dt)).view(torch.int16).to(torch.int32) & 0xFFFF
            regs[d] = int(prod[0]) | (int(prod[1]) << 16)
        else:
            raise AssertionError(f"unknown PTX op {op}")
    return regs


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_ptx_decoder_emulated_on_every_byte(kind: str):
    """The DECODE=1 PTX (run here through a small emulator) gives e2m1(nibble) * scale exactly for all 256
    byte values, with distinct scales per element pair: checks the tables, the pairing and the sign bits."""
    triton_mod = pytest.importorskip("k3run.kernels.nvfp4_gemm.triton")
    from k3run.formats import e2m1_decode

    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = triton_mod.decode_asm(kind)
    scales = torch.tensor([0.375, 3.0, 2.0**-9, 448.0], dtype=dt)
    sbits = scales.view(torch.int16).to(torch.int32) & 0xFFFF
    pair = [int(sbits[0]) | int(sbits[1]) << 16, int(sbits[2]) | int(sbits[3]) << 16]
    for word in range(64):
        b = [4 * word + i for i in range(4)]
        regs = _emulate_ptx(
            asm,
            {
                "$4": b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24,
                "$5": pair[0],
                "$6": pair[1],
                "$7": pair[1],
                "$8": pair[0],
            },
        )
        out = [regs[f"${i}"] for i in range(4)]
        halves = (
            torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16).view(dt)
        )
        codes = torch.tensor(b, dtype=torch.uint8)
        lo, hi = e2m1_decode(codes & 0xF), e2m1_decode(codes >> 4)
        s_lo = scales.float()
        s_hi = scales.float()[[2, 3, 0, 1]]
        assert torch.equal(halves[:2].reshape(4).float(), lo * s_lo), (kind, b)
        assert torch.equal(halves[2:].reshape(4).float(), hi * s_hi), (kind, b)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_gemv_word_decoder_emulated_on_every_byte(kind: str):
    """The Gluon decode kernel's PTX (one 32-bit word per call, the two scales packed in one register) gives
    e2m1(nibble) * scale exactly for every byte value in every byte position, positive and negative."""
    gemv = pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
    from k3run.formats import e2m1_decode

    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = gemv.word_decode_asm(kind)
    for s_lo, s_hi in [(0.375, 448.0), (2.0**-9, 3.0)]:
        sbits = torch.tensor([s_lo, s_hi], dtype=dt).view(torch.int16).to(torch.int32) & 0xFFFF
        for word in range(256):
            b = [(word + 37 * i) % 256 for i in range(4)]  # every byte value lands in every position
            word_bits = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
            tables = {f"${6 + i}": v for i, v in enumerate(gemv.decode_table_words(kind)[:4])}
            regs = _emulate_ptx(asm, {"$4": word_bits, "$5": int(sbits[0]) | int(sbits[1]) << 16, **tables})
            out = [regs[f"${i}"] for i in range(4)]
            halves = (
                torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16).view(dt)
            )
            codes = torch.tensor(b, dtype=torch.uint8)
            assert torch.equal(halves[:2].reshape(4).float(), e2m1_decode(codes & 0xF) * s_lo), (kind, b)
            assert torch.equal(halves[2:].reshape(4).float(), e2m1_decode(codes >> 4) * s_hi), (kind, b)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_gemv_scale_pair_asm_emulated_on_every_e4m3_pair(kind: str):
    """The cp.async kernel's scale PTX (two E4M3 bytes -> one word of two 16-bit floats; bf16 through the
    f16 bits >> 3 and an exact 2^112 multiply) gives exactly the E4M3 values for every pair of finite
    non-negative scales (0x00..0x7E), each byte in its own half."""
    gemv = pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = gemv._SCALE_ASM_BF16 if kind == "bf16" else gemv._SCALE_ASM
    c112 = gemv.decode_table_words(kind)[4]
    codes = torch.arange(127, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(want.to(dt).float(), want)  # every E4M3 value is exact in bf16 and fp16
    for lo in range(127):
        for hi in range(0, 127, 7) if lo % 9 else range(127):
            regs = _emulate_ptx(asm, {"$1": lo, "$2": hi, "$3": c112})
            out = regs["$0"]
            halves = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(dt)
            assert halves.float().tolist() == [want[lo].item(), want[hi].item()], (kind, lo, hi)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_tiled_word_decoder_emulated_on_every_byte(kind: str):
    """The tiled layout's shift decoders (per pair: shifts of the whole word, a mask, a merge; then a multiply
    by s * 2^119 in bf16 or s * 2^7 in fp16) on words packed by tiled_word: every byte value in every
    position, both signs, subnormal and large scales. Both give e2m1 * s * 2^-7 (the kernel multiplies by
    2^7 = SHIFT_OUT_SCALE): the e = 0 codes pass through bf16 / fp16 subnormals, so a flush would fail."""
    gemv = pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
    from k3run.formats import e2m1_decode
    from k3run.kernels.nvfp4_gemm import tiled_word

    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = gemv.tiled_word_decode_asm(kind)
    factor = 2.0**119 if kind == "bf16" else 2.0**7
    unit = 1.0 / gemv.SHIFT_OUT_SCALE
    for s_lo, s_hi in [(0.375, 448.0), (2.0**-9, 3.0), (0.0, 1.0)]:
        sbits = (
            torch.tensor([s_lo * factor, s_hi * factor], dtype=dt).view(torch.int16).to(torch.int32) & 0xFFFF
        )
        for word in range(256):
            b = [(word + 37 * i) % 256 for i in range(4)]  # logical split128 bytes
            regs = _emulate_ptx(asm, {"$4": tiled_word(b), "$5": int(sbits[0]) | int(sbits[1]) << 16})
            out = [regs[f"${i}"] for i in range(4)]
            halves = (
                torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16).view(dt)
            )
            codes = torch.tensor(b, dtype=torch.uint8)
            lo, hi = e2m1_decode(codes & 0xF) * s_lo * unit, e2m1_decode(codes >> 4) * s_hi * unit
            assert torch.equal(halves[:2].reshape(4).float(), lo), (kind, b, s_lo)
            assert torch.equal(halves[2:].reshape(4).float(), hi), (kind, b, s_hi)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_tile_gemm_word_decoder_emulated(kind: str):
    """The tile GEMM's decoder (tile.word_asm: the raw E4M3 scale pair converted in the block, then the tiled
    word decoder) gives e2m1 * s * 2^-7 exactly for every byte value in every position of the word, over
    scale pairs from the smallest subnormal E4M3 to 448."""
    pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
    from k3run.formats import e2m1_decode
    from k3run.kernels.nvfp4_gemm import tiled_word
    from k3run.kernels.nvfp4_gemm.tile import SHIFT_OUT_SCALE, word_asm

    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = word_asm(kind)
    for s_lo_bits, s_hi_bits in [(0x01, 0x7E), (0x30, 0x38), (0x7E, 0x08), (0x45, 0x45)]:
        s_lo, s_hi = (
            torch.tensor([s_lo_bits, s_hi_bits], dtype=torch.uint8).view(torch.float8_e4m3fn).tolist()
        )
        for word in range(256):
            b = [(word + 37 * i) % 256 for i in range(4)]
            regs = _emulate_ptx(asm, {"$4": tiled_word(b), "$5": s_lo_bits | s_hi_bits << 8})
            out = [regs[f"${i}"] for i in range(4)]
            halves = (
                torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16).view(dt)
            )
            codes = torch.tensor(b, dtype=torch.uint8)
            unit = 1.0 / SHIFT_OUT_SCALE
            lo, hi = e2m1_decode(codes & 0xF) * s_lo * unit, e2m1_decode(codes >> 4) * s_hi * unit
            assert torch.equal(halves[:2].reshape(4).float(), lo), (kind, b, s_lo)
            assert torch.equal(halves[2:].reshape(4).float(), hi), (kind, b, s_hi)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_shift_decoder_scale_asm_emulated_on_every_e4m3_pair(kind: str):
    """The tiled scale PTX (one word of 4 E4M3 bytes in TILED_SCALE_ORDER -> the pairs of two groups: cvt to
    f16x2, then an exponent add) gives exactly s * 2^119 (bf16) / s * 2^7 (fp16) for every pair of finite
    positive E4M3 scales in both halves of the word (a zero scale gives a nonzero factor: tile_split128
    zeroes those groups' codes, tested above)."""
    gemv = pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
    dt = torch.bfloat16 if kind == "bf16" else torch.float16
    asm = gemv._SCALE_WORD_ASM_BF16 if kind == "bf16" else gemv._SCALE_WORD_ASM_FP16
    factor = 2.0**119 if kind == "bf16" else 2.0**7
    want = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * factor
    assert torch.equal(want.to(dt).float(), want)

    def halves(word: int) -> list[float]:
        return torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(dt).tolist()

    for lo in range(1, 127):
        for hi in range(1, 127, 5) if lo % 7 else range(1, 127):
            lo2, hi2 = 127 - lo, 1 + (hi * 37) % 126  # the other group of the word
            out = _emulate_ptx(asm, {"$2": lo | hi << 8 | lo2 << 16 | hi2 << 24})
            assert halves(out["$0"]) == [want[lo].item(), want[hi].item()], (kind, lo, hi)
            assert halves(out["$1"]) == [want[lo2].item(), want[hi2].item()], (kind, lo2, hi2)


def test_small_matrices_keep_the_decode_kernel_up_to_32_rows_on_sm90() -> None:
    """choose_config with the wgmma GEMM available (sm_90): Kimi Linear's dense shapes (under 32M weights)
    take the decode kernel at 17..32 rows, where bench_wgmma measured it 1.03-1.6x faster (run 141), and
    the wgmma GEMM from 33; K3's large matrices take the wgmma path (the CUDA GEMM) from 17."""
    from k3run.kernels.nvfp4_gemm import WGMMA_SMALL_M_MIN_WEIGHTS

    for n, k in ((12448, 2304), (2304, 4096), (2048, 2304), (4096, 128)):
        assert n * k < WGMMA_SMALL_M_MIN_WEIGHTS
        for m in (17, 24, 32):
            cfg = choose_config(m, n, k, wgmma=True)
            assert cfg.gemv and not cfg.wgmma, (n, k, m, cfg)
        assert choose_config(33, n, k, wgmma=True).wgmma and choose_config(64, n, k, wgmma=True).wgmma
    for n, k in ((7168, 7168), (12288, 7168), (7168, 12288)):
        assert all(choose_config(m, n, k, wgmma=True).wgmma for m in (17, 32, 64, 256))
    assert choose_config(16, 7168, 7168, wgmma=True).gemv
