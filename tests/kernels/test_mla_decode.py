"""Absorbed MLA decode attention: the split-context Triton kernel against the fp32 windowed reference.

Error bounds. fp32 caches: the kernel's dots run in fp32 (`ieee`), so only the summation order differs:
relative RMS <= 1e-5. 16-bit caches: the queries and the probabilities are rounded to the cache dtype
before the dots (the latents are exact in it). Rounding q by 2^-p relative moves a score by about
2^-p * |q| |c| * scale, ~1.5 * 2^-p for the unit-variance data here, and each probability by as much in
relative terms; rounding p adds 2^-p. fp16 (p = 11): ~2.5 * 2^-11 ~ 1.2e-3, bound 4e-3; bf16 (p = 8, 2^-9
per rounding): ~5e-3, bound 1.5e-2.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules. The
interpreter's dots take fp32 and fp16 only, so bf16 runs on the GPU only.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.mla import mla_decode_attention, mla_decode_ref
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.5e-2}


def _case(dtype: torch.dtype, device: str, H: int, L: int, R: int, contexts: list[int], window: int):
    B, S = len(contexts), len(contexts) + 2
    store = torch.randn(S, window + 5, L + R).to(dtype).to(device)
    slots = torch.randperm(S)[:B].to(device)
    ctx = torch.tensor(contexts, device=device)
    q_lat = torch.randn(B, H, L, device=device)
    q_pe = torch.randn(B, H, R, device=device)
    scale = (128 + R) ** -0.5
    return q_lat, q_pe, store, slots, ctx, window, scale


def _check(dtype: torch.dtype, device: str, **kw) -> None:
    from k3run.kernels.mla.triton import mla_decode_triton

    H, L, R = kw.pop("H"), kw.pop("L"), kw.pop("R")
    contexts, window = kw.pop("contexts"), kw.pop("window")
    args = _case(dtype, device, H, L, R, contexts, window)
    ref = mla_decode_ref(*args)
    out = mla_decode_triton(*args, **kw)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert_close("mla decode o_lat", ref, out, RTOL[dtype])


def test_cpu_dispatch_is_the_reference() -> None:
    args = _case(torch.bfloat16, "cpu", H=3, L=16, R=8, contexts=[0, 5, 9], window=12)
    assert torch.equal(mla_decode_attention(*args), mla_decode_ref(*args))


def test_absorb_kernels_run_up_to_the_knobs_batch_on_cuda_only() -> None:
    """K3RUN_MLA_ABSORB_KERNELS is a batch bound (default 64, where the tensor-core forms were measured
    faster than torch's chain), on CUDA only."""
    from k3run.kernels.mla import absorb_kernels_enabled
    from k3run.knobs import override_knobs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with override_knobs(mla_absorb_kernels=8):
        assert absorb_kernels_enabled(cuda, 1) and absorb_kernels_enabled(cuda, 8)
        assert not absorb_kernels_enabled(cuda, 9) and not absorb_kernels_enabled(cpu, 1)
    with override_knobs(mla_absorb_kernels=0):
        assert not absorb_kernels_enabled(cuda, 1)
    assert absorb_kernels_enabled(cuda, 64) and not absorb_kernels_enabled(cuda, 65)  # the default
    from k3run.kernels.mla.triton import o_block

    assert o_block(32, 32) == 16 and o_block(64, 32) == 32 and o_block(16, 96) == 32 and o_block(8, 96) == 16


def test_choose_splits_fills_the_machine_within_the_window() -> None:
    from k3run.kernels.mla.triton import choose_splits

    assert choose_splits(batch=1, window=4096, head_blocks=6, sms=132) == 44  # ~2 programs per SM
    assert choose_splits(batch=1, window=256, head_blocks=6, sms=132) == 4  # >= 64 positions a split
    assert choose_splits(batch=64, window=4096, head_blocks=6, sms=132) == 1


def test_decode_config_keeps_splits_long_above_4096_positions() -> None:
    """Splits of >= 256 positions above 4096-position windows, 64 at and below, and the stages
    (bench/RESULTS.md)."""
    from k3run.kernels.mla.triton import choose_splits, decode_config, shares_splits

    for batch in (1, 8, 32):
        assert decode_config(batch, 4096)["min_chunk"] == 64
        assert decode_config(batch, 8192)["min_chunk"] == 256
    # three stages below 8 sequences above 4096 positions (one block in flight), else two
    assert [decode_config(b, w)["num_stages"] for b, w in ((1, 4096), (1, 8192), (7, 65536), (8, 8192))] == [
        2, 3, 3, 2,
    ]  # fmt: skip
    # the shared layout from 32 (sequence, 32-head block) pairs, or 8 at >= 32K-position windows (runs
    # 237-241); K3RUN_MLA_SHARED_SPLITS forces either layout
    from k3run.knobs import override_knobs

    cases = [
        (1, 65536, 32), (7, 65536, 32), (8, 16384, 32), (8, 32768, 32), (31, 2048, 32), (32, 2048, 32),
        (2, 65536, 96), (3, 32768, 96), (3, 16384, 96), (10, 4096, 96), (11, 4096, 96), (64, 4096, 16),
    ]  # fmt: skip
    want = [False, False, False, True, False, True, False, True, False, False, True, True]
    assert [decode_config(b, w, h)["shared"] for b, w, h in cases] == want
    assert [shares_splits(b, w, h) for b, w, h in cases] == want
    for forced in (False, True):
        with override_knobs(mla_shared_splits=forced):
            assert {decode_config(b, w, h)["shared"] for b, w, h in cases} == {forced}
    # one sequence of 8K at 32 heads: 64 splits of 256 positions (of which the context fills half), not 256
    cfg = decode_config(1, 16384)
    assert choose_splits(1, 16384, 1, 132, cfg["min_chunk"], cfg["per_sm"]) == 64


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=39)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_mla_decode_kernel(dtype: torch.dtype) -> None:
    # 5 heads in blocks of 16 (masked), 3 splits of 8 positions in blocks of 16 (masked): the first
    # sequence sees one position (two empty splits), the last reaches into the third split
    _check(dtype, "cpu", H=5, L=32, R=16, contexts=[0, 7, 20], window=24, splits=3, block_n=16)


@interp_only
def test_interp_mla_merge_over_more_splits_than_a_step_and_column_blocks() -> None:
    # 40 splits of 4 positions: the merge takes them in steps of MERGE_SPLITS (the last step part-masked),
    # the 256 latent columns in blocks of MERGE_COLS; the short sequences leave most splits empty (never
    # written, so their o must not be read), the long one fills them all
    from k3run.kernels.mla import triton as mla

    assert 40 > mla.MERGE_SPLITS and 40 % mla.MERGE_SPLITS and 256 > mla.MERGE_COLS
    _check(torch.float32, "cpu", H=3, L=256, R=16, contexts=[0, 37, 159], window=160, splits=40, block_n=16)


@interp_only
def test_interp_mla_merge_in_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # above MERGE_PAIRS (sequence, head) pairs a merge program takes a whole latent row, MERGE_TILE / L
    # splits a step: 40 splits of 256 columns are 16 a step, the last step part-masked
    from k3run.kernels.mla import triton as mla

    monkeypatch.setattr(mla, "MERGE_PAIRS", 0)
    assert 40 % (mla.MERGE_TILE // 256)
    _check(torch.float32, "cpu", H=3, L=256, R=16, contexts=[0, 37, 159], window=160, splits=40, block_n=16)


@interp_only
@pytest.mark.parametrize(
    "contexts, window, total",
    [
        ([0, 7, 20, 100], 128, 8),  # a long one among short ones: most of the 8 programs
        ([31, 31, 31], 32, 6),  # equal lengths filling the window: 2 pieces each
        ([2, 10_000, 40], 48, 5),  # a corrupt length past the window attends the whole window
        ([(13 * i) % 37 for i in range(70)], 40, 16),  # > 64 sequences: the shares in two passes of 64
        ([15, 15], 16, 40),  # more programs than pieces can be: the grid capped at B x 4, every row a piece
    ],
)
def test_interp_mla_shared_splits(contexts: list[int], window: int, total: int) -> None:
    # the `shared` layout: each sequence's pieces by its length, partial rows in sequence order, the merge
    # finding each sequence's rows again; min_chunk 4 so that short sequences still take several pieces
    _check(torch.float32, "cpu", H=3, L=16, R=8, contexts=contexts, window=window, splits=total, block_n=8,
           min_chunk=4, shared=True)  # fmt: skip


@interp_only
def test_interp_mla_decode_kernel_never_reads_past_the_window() -> None:
    # a context length past the window (a corrupt length) attends the whole window, as the reference's mask
    # does, instead of reading positions beyond it
    _check(torch.float32, "cpu", H=3, L=16, R=8, contexts=[2, 10_000], window=16, splits=2, block_n=16)


def _absorb_case(B: int, H: int, dn: int, L: int, R: int, dv: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(B * 1000 + H * 10 + dn)
    q = torch.randn(B, H, dn + R, generator=g).to(dtype).to(device)
    w_uk = (torch.randn(H, dn, L, generator=g) / dn**0.5).to(device)
    w_uv = (torch.randn(H, dv, L, generator=g) / L**0.5).to(device)
    return q, w_uk, w_uv


def check_absorb(B: int, H: int, dn: int, L: int, R: int, dv: int, dtype: torch.dtype, device: str,
                 dot: bool | None = None, out_dtype: torch.dtype | None = None,
                 fma: bool | None = None) -> None:  # fmt: skip
    """The two absorb kernels (`dot`: their forms, as `absorb_dot` picks) against their references. The
    joined queries are fp32 sums of dn products in another order: relative RMS <= RTOL[fp32] (the dot forms'
    products are exact too, tc_split; their tensor-core sums may truncate, 2 u an addition, far below it).
    The output is an fp32 sum of L products rounded once to dtype: where the two orders straddle a rounding
    boundary they land one ulp apart, so the bound is one rounding of dtype (fp32: the order alone);
    `out_dtype` (default dtype) is the output's; `fma` forces the FMA forms (fused products, the same
    bounds)."""
    from k3run.kernels.mla import mla_o_absorb_ref, mla_q_absorb_ref
    from k3run.kernels.mla.triton import mla_o_absorb_triton, mla_q_absorb_triton
    from k3run.testing import RTOL as DTYPE_RTOL

    q, w_uk, w_uv = _absorb_case(B, H, dn, L, R, dv, dtype, device)
    joined = mla_q_absorb_triton(q, w_uk, dot=dot, fma=fma)
    ref = mla_q_absorb_ref(q.cpu(), w_uk.cpu())
    assert joined.shape == (B, H, L + R) and joined.dtype == torch.float32
    assert_close("absorbed queries", ref, joined.cpu(), RTOL[torch.float32])
    assert torch.equal(joined[..., L:].cpu(), q[..., dn:].float().cpu()), "the RoPE part is a plain copy"
    o_lat = torch.randn(B, H, L, device=device)
    out_dtype = out_dtype or dtype
    out = mla_o_absorb_triton(o_lat, w_uv, out_dtype, dot=dot, fma=fma)
    ref_o = mla_o_absorb_ref(o_lat.cpu(), w_uv.cpu(), out_dtype)
    assert out.shape == (B, H, dv) and out.dtype == out_dtype
    assert_close("output out of latent space", ref_o.float(), out.float().cpu(), DTYPE_RTOL[out_dtype])


def check_decode_absorbed(dtype: torch.dtype, device: str, H: int, dn: int, L: int, R: int, dv: int,
                          contexts: list[int], window: int) -> None:  # fmt: skip
    """The four-launch static decode attention against the composed references: the decode kernel's
    bound for the cache dtype (the absorb kernels' fp32 order is far below it) plus one rounding of the
    activation dtype (the cache's here)."""
    from k3run.kernels.mla import mla_decode_absorbed, mla_o_absorb_ref, mla_q_absorb_ref
    from k3run.testing import RTOL as DTYPE_RTOL

    B = len(contexts)
    q, w_uk, w_uv = _absorb_case(B, H, dn, L, R, dv, dtype, device)
    _, _, store, slots, ctx, _, scale = _case(dtype, device, H, L, R, contexts, window)
    out = mla_decode_absorbed(q, w_uk, w_uv, store, slots, ctx, window, scale, dtype)
    joined = mla_q_absorb_ref(q.cpu(), w_uk.cpu())
    o_lat = mla_decode_ref(
        joined[..., :L], joined[..., L:], store.cpu(), slots.cpu(), ctx.cpu(), window, scale
    )
    ref = mla_o_absorb_ref(o_lat, w_uv.cpu(), torch.float32)
    assert out.shape == (B, H, dv) and out.dtype == dtype
    assert_close("absorbed decode attention", ref, out.float().cpu(), RTOL[dtype] + DTYPE_RTOL[dtype])


def check_latent_store(B: int, L: int, R: int, dtype: torch.dtype, device: str) -> None:
    """The latent store kernel against the reference: the normalised columns are one rounding of dtype from
    fp32 values computed in another order (a multiply by 1 / sqrt where the reference divides): bound
    RTOL[dtype]; the RoPE columns are copies. Untouched cache rows stay as they were, and a position past
    the cache (the last row's) writes nothing."""
    from k3run.kernels.mla import mla_latent_store_ref
    from k3run.kernels.mla.triton import mla_latent_store_triton
    from k3run.testing import RTOL as DTYPE_RTOL

    g = torch.Generator().manual_seed(B * 7 + L)
    kv_a = (torch.randn(B, L + R + 3, generator=g) * 2).to(dtype)[:, : L + R]  # a row stride past L + R
    weight = torch.rand(L, generator=g) + 0.5
    S, N = B + 2, 9
    store = torch.randn(S, N, L + R, generator=g).to(dtype)
    slots = torch.randperm(S, generator=g)[:B]
    positions = torch.randint(0, N, (B,), generator=g)
    positions[-1] = N + 4  # corrupt: past the cache
    want = store.clone()
    mla_latent_store_ref(kv_a[:-1], weight, 1e-6, want, slots[:-1], positions[:-1])
    got = store.to(device)
    mla_latent_store_triton(
        kv_a.to(device), weight.to(device), 1e-6, got, slots.to(device), positions.to(device)
    )
    got = got.cpu()
    rows = (slots[:-1], positions[:-1])
    assert_close("normalised latents", want[rows][:, :L].float(), got[rows][:, :L].float(), DTYPE_RTOL[dtype])
    assert torch.equal(got[rows][:, L:], want[rows][:, L:]), "the RoPE columns are copies"
    untouched = torch.ones(S, N, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got[untouched], store[untouched]), "a row no token owns was written"


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_latent_store(dtype: torch.dtype) -> None:
    check_latent_store(4, 32, 16, dtype, "cpu")


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_absorb_kernels(dtype: torch.dtype) -> None:
    # 24 NoPE columns (a block of 32, masked), 20 output columns (blocks of 8, the last masked)
    check_absorb(3, 5, 24, 64, 16, 20, dtype, "cpu")


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B", [3, 19, 70])
def test_interp_absorb_dot_forms(dtype: torch.dtype, B: int) -> None:
    # the tensor-core forms (the same split through fp32 dots here): bf16 q as it is, fp16 / fp32 q split
    # too; 19 and 70 sequences: one and two sequence blocks of each kernel, the last partly masked. (A bf16
    # output is checked on the GPU: the interpreter's casts truncate, up to twice a rounding's error.)
    out_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    check_absorb(B, 3, 24, 64, 16, 20, dtype, "cpu", dot=True, out_dtype=out_dtype)


def check_absorb_dot_exact(H: int, dn: int, L: int, dv: int, device: str, fma: bool = False) -> None:
    """The dot forms multiply exactly, each factor's parts whole: a one-hot query or o_lat returns W_UK's row
    or W_UV's column bit for bit (the weight's split), and a one-hot weight returns the fp32 query or o_lat
    (theirs). A random-input bound cannot see a lost or rounded part (its error is below the fp32 sum's);
    these can. `fma`: the same of the FMA forms (each product fused into its sum, exact as well)."""
    from functools import partial

    from k3run.kernels.mla.triton import mla_o_absorb_triton, mla_q_absorb_triton

    mla_q_absorb_triton = partial(mla_q_absorb_triton, fma=fma)
    mla_o_absorb_triton = partial(mla_o_absorb_triton, fma=fma)

    R = 16
    _, w_uk, w_uv = _absorb_case(1, H, dn, L, R, dv, torch.float32, device)
    g = torch.Generator().manual_seed(dn + L)
    B = 2 * dn
    pick = torch.arange(B) % dn
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(B, H, dn + R, dtype=dtype, device=device)
        q[torch.arange(B), :, pick] = 1.0  # sequence b picks W_UK's row b % dn in every head
        joined = mla_q_absorb_triton(q, w_uk, dot=True)
        assert torch.equal(joined[..., :L], w_uk[:, pick].transpose(0, 1)), f"{dtype} q: not W_UK's row"
    eye_k = torch.zeros(H, dn, L, device=device)
    eye_k[:, torch.arange(L) % dn, torch.arange(L)] = 1.0  # latent column l copies query column l % dn
    q = torch.randn(5, H, dn + R, generator=g).to(device)
    want = q[..., torch.arange(L) % dn]
    assert torch.equal(mla_q_absorb_triton(q, eye_k, dot=True)[..., :L], want), "fp32 q: a part was lost"
    o_lat = torch.zeros(L, H, L, device=device)
    o_lat[torch.arange(L), :, torch.arange(L)] = 1.0  # sequence b picks W_UV's column b
    out = mla_o_absorb_triton(o_lat, w_uv, torch.float32, dot=True)
    assert torch.equal(out, w_uv.permute(2, 0, 1)), "o_lat one-hot: not W_UV's column"
    eye_v = torch.zeros(H, dv, L, device=device)
    eye_v[:, torch.arange(dv), torch.arange(dv) % L] = 1.0  # output column v copies latent column v % L
    o_lat = torch.randn(5, H, L, generator=g).to(device)
    out = mla_o_absorb_triton(o_lat, eye_v, torch.float32, dot=True)
    assert torch.equal(out, o_lat[..., torch.arange(dv) % L]), "fp32 o_lat: a part was lost"


@interp_only
@pytest.mark.parametrize("fma", [False, True])
def test_interp_absorb_dot_forms_are_exact_products(fma: bool) -> None:
    check_absorb_dot_exact(3, 24, 64, 20, "cpu", fma=fma)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 5, 19])
def test_interp_absorb_fma_forms(dtype: torch.dtype, B: int) -> None:
    # the fp32 FMA forms: one sequence, a block partly masked, two blocks (their exactness: above)
    out_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    check_absorb(B, 3, 24, 64, 16, 20, dtype, "cpu", out_dtype=out_dtype, fma=True)


@interp_only
@pytest.mark.parametrize("B", [1, 4])
def test_interp_absorb_kernels_loaded_ahead_are_the_same_bits(B: int) -> None:
    """Each sequence's row loaded while the previous one's is used (the default) or after it: the same
    products and sums, so the same bits (one sequence: the prefetch past it fully masked)."""
    from k3run.kernels.mla.triton import mla_o_absorb_triton, mla_q_absorb_triton

    q, w_uk, w_uv = _absorb_case(B, 3, 24, 64, 16, 20, torch.float16, "cpu")
    assert torch.equal(mla_q_absorb_triton(q, w_uk), mla_q_absorb_triton(q, w_uk, ahead=False))
    o_lat = torch.randn(B, 3, 64, generator=torch.Generator().manual_seed(B))
    ahead = mla_o_absorb_triton(o_lat, w_uv, torch.float16)
    assert torch.equal(ahead, mla_o_absorb_triton(o_lat, w_uv, torch.float16, False))


@interp_only
@pytest.mark.parametrize("dot", [False, True])
def test_interp_queries_in_the_cache_dtype_are_the_same_bits(dot: bool) -> None:
    """The absorb kernels writing the joined queries in a 16-bit cache's dtype round the same fp32 sums
    once, and the decode kernel rounds fp32 queries to that dtype itself: both outputs are bit-equal to
    the fp32 path's."""
    from k3run.kernels.mla.triton import mla_decode_joined_triton, mla_q_absorb_triton

    q, w_uk, _ = _absorb_case(4, 3, 24, 32, 16, 20, torch.float16, "cpu")
    wide = mla_q_absorb_triton(q, w_uk, dot=dot)
    narrow = mla_q_absorb_triton(q, w_uk, dot=dot, out_dtype=torch.float16)
    assert narrow.dtype == torch.float16 and torch.equal(narrow, wide.to(torch.float16))
    _, _, store, slots, ctx, window, scale = _case(torch.float16, "cpu", 3, 32, 16, [0, 9, 30, 17], 32)
    args = (store, slots, ctx, window, scale)
    assert torch.equal(mla_decode_joined_triton(wide, 32, *args), mla_decode_joined_triton(narrow, 32, *args))


@interp_only
def test_interp_decode_absorbed() -> None:
    check_decode_absorbed(torch.float32, "cpu", H=5, dn=24, L=32, R=16, dv=20, contexts=[0, 7, 20], window=24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_absorb_kernels_and_decode_at_kimi_widths(batch: int) -> None:
    """Kimi Linear's and K3's MLA widths (128 NoPE, 512 latent, 64 RoPE, 128 value columns), 32 heads."""
    check_absorb(batch, 32, 128, 512, 64, 128, torch.bfloat16, "cuda")
    check_absorb(batch, 32, 128, 512, 64, 128, torch.float32, "cuda")
    check_latent_store(batch + 1, 512, 64, torch.bfloat16, "cuda")
    contexts = [0, 100, 1000, 4095, 7, 2047, 3000, 1][:batch]
    check_decode_absorbed(torch.bfloat16, "cuda", H=32, dn=128, L=512, R=64, dv=128, contexts=contexts,
                          window=4096)  # fmt: skip


def test_absorb_fma_forms_take_steps_up_to_the_knob() -> None:
    """K3RUN_MLA_ABSORB_FMA (default 0: never) picks the FMA forms for steps of up to that many sequences,
    unless a form is forced (`dot`, for tests and the benchmark); `fma` forces it either way."""
    pytest.importorskip("triton")
    from k3run.kernels.mla.triton import absorb_fma
    from k3run.knobs import override_knobs

    assert not absorb_fma(1, None, None)
    with override_knobs(mla_absorb_fma=8):
        assert absorb_fma(8, None, None) and not absorb_fma(9, None, None)
        assert not absorb_fma(4, True, None) and not absorb_fma(4, False, None)
        assert absorb_fma(64, None, True) and not absorb_fma(4, None, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8, 19])
def test_gpu_absorb_fma_forms_at_kimi_widths(batch: int) -> None:
    """The FMA forms at Kimi's MLA widths against the references (bf16 and fp32 queries), their one-hot
    exactness, and the four-launch decode with them picked by the knob."""
    from k3run.knobs import override_knobs

    check_absorb(batch, 32, 128, 512, 64, 128, torch.bfloat16, "cuda", fma=True)
    check_absorb(batch, 32, 128, 512, 64, 128, torch.float32, "cuda", fma=True)
    check_absorb_dot_exact(32, 128, 512, 128, "cuda", fma=True)
    contexts = [0, 100, 1000, 4095, 7, 2047, 3000, 1] * 3
    with override_knobs(mla_absorb_fma=32):
        check_decode_absorbed(torch.bfloat16, "cuda", H=32, dn=128, L=512, R=64, dv=128,
                              contexts=contexts[:batch], window=4096)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [8, 33, 70])
def test_gpu_absorb_dot_forms_at_kimi_widths(batch: int) -> None:
    """The tensor-core forms at Kimi's MLA widths: bf16 and fp32 queries, one and two sequence blocks, and
    the one-hot exactness (which the bf16 dot on the tensor cores must keep: the interpreter's fp32 dots
    cannot show a part lost there); then the four-launch decode with the forms as `absorb_dot` picks them."""
    check_absorb(batch, 32, 128, 512, 64, 128, torch.bfloat16, "cuda", dot=True)
    check_absorb(batch, 32, 128, 512, 64, 128, torch.float32, "cuda", dot=True)
    check_absorb_dot_exact(32, 128, 512, 128, "cuda")
    from k3run.kernels.mla.triton import mla_o_absorb_triton
    from k3run.testing import RTOL as DTYPE_RTOL

    _, _, w_uv = _absorb_case(batch, 32, 128, 512, 64, 128, torch.bfloat16, "cuda")
    o_lat = torch.randn(batch, 32, 512, device="cuda")
    plain = mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, dot=True)
    # the benchmark's variants: 32 sequences a block and 8 warps make the same sums; other latent steps sum
    # in another order (one bf16 rounding apart at most)
    for tiles in [(16, 64, 32), (16, 64, 16, 8)]:
        assert torch.equal(mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, dot=True, tiles=tiles), plain)
    for tiles in [(16, 32, 16), (16, 128, 16)]:
        other = mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, dot=True, tiles=tiles)
        assert_close(f"o absorb, tiles {tiles}", plain.float(), other.float(), DTYPE_RTOL[torch.bfloat16])
    contexts = [(7 * i * i + 13 * i) % 4096 for i in range(batch)]
    check_decode_absorbed(torch.bfloat16, "cuda", H=32, dn=128, L=512, R=64, dv=128, contexts=contexts,
                          window=4096)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_mla_decode_kernel_at_k3_widths(dtype: torch.dtype, batch: int) -> None:
    """The launches decode_config makes below and from 8 sequences (8 and 4 warps, ~2 and ~4 programs per
    SM), on the same four sequences."""
    from k3run.kernels.mla.triton import decode_config

    kw = decode_config(batch, 4096)
    _check(dtype, "cuda", H=96, L=512, R=64, contexts=[0, 100, 1000, 4095], window=4096, **kw)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_kernel_compiles_for_sm90_at_k3_widths_without_spills_in_the_loop(batch: int, shared: bool) -> None:
    """The launches `decode_config` picks for a bf16 cache at K3's widths, compiled for sm_90 on the CPU with
    the specialisations the runtime makes (16-byte aligned pointers, 16-divisible strides): they must build,
    stage the latents by cp.async (the pipeliner needs those strides), use the tensor cores (mma) and fit the
    shared memory. The 8-warp launch (batch < 8) must keep its loop free of local-memory traffic. The 4-warp
    launch (batch >= 8) holds a [32, 512] fp32 accumulator in 128 threads and sits at the 255-register limit:
    Triton 3.6 (the H200 image, where it was the fastest, runs 57-58) spills 16 bytes, Triton 3.9 (CI) 144
    bytes inside the loop, so for it only the build is checked here; its speed is the benchmark's job. Both
    layouts of the splits (`shared`: `_mla_decode_shared_kernel`, the pieces found from the batch's lengths
    before the loop)."""
    import inspect
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3run.kernels.mla.triton import _mla_decode_shared_kernel, _mla_decode_split_kernel, decode_config
    from tests.kernels.test_nvfp4_gemv_compile import _local_accesses_in_loops, cubin_usage_and_sass

    cfg = decode_config(batch, 16384)
    kernel = _mla_decode_shared_kernel if shared else _mla_decode_split_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    consts = dict(L=512, R=64, BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], IEEE=False, PDL=False)
    types = dict(q_ptr="*fp32", store_ptr="*bf16", slots_ptr="*i64", ctx_ptr="*i64", o_ptr="*fp32",
                 lse_ptr="*fp32", H="i32", B="i32", SPLITS="i32", chunk="i32", TOTAL="i32",
                 min_chunk="i32", window="i32", stride_slot="i64", stride_pos="i32",
                 scale="fp32")  # fmt: skip
    sig = {n: ("constexpr" if n in consts else types[n]) for n in params}
    div16 = [n for n in params if n.endswith("_ptr") or n in ("stride_slot", "stride_pos")]
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(kernel, sig, {(params.index(c),): v for c, v in consts.items()}, attrs)
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = ck.asm["ptx"]
    assert "mma" in ptx and "cp.async" in ptx
    assert ck.metadata.shared <= 232448, f"{ck.metadata.shared} bytes of shared memory (sm_90: 227 KB)"
    res, sass = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    assert use is not None, res
    assert int(use.group(4)) == 0, f"local memory: {use.group(0)}"
    in_loop = _local_accesses_in_loops(sass)
    if cfg["num_warps"] == 8:
        assert not in_loop, f"spilled inside a loop ({use.group(0)}): {in_loop}"


@pytest.mark.parametrize("which", ["q", "o", "q dot", "q dot, fp32 q", "o dot", "q fma", "o fma"])
def test_absorb_kernels_compile_for_sm90_without_spills(which: str) -> None:
    """At Kimi's widths (128 NoPE, 512 latent, 64 RoPE, 128 value columns) the weight tile each program holds
    (32 latent x 128 NoPE, or 8 value x 512 latent, fp32) fits its 128 threads' registers, with the next
    sequence's row loaded ahead. The dot forms: the weight tile's three bf16 parts with 64 bf16 (16 split
    fp32) query rows, or o_lat's and W_UV's [16, 64] / [64, 16] steps split, the next step loaded ahead;
    their products on the tensor cores. The FMA forms: the same tiles in fp32, one FMA dot (no tensor
    core)."""
    import inspect
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3run.kernels.mla import triton as mt
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    q_types = dict(q_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32")
    o_types = dict(o_ptr="*fp32", w_ptr="*fp32", out_ptr="*bf16")
    q_dot = dict(DN=128, L=512, R=64, BLOCK_DN=128, BL=32, PDL=True, TC=True, FMA=False)
    kernel, consts, types = {
        "q": (mt._mla_q_absorb_kernel, dict(DN=128, L=512, R=64, BLOCK_DN=128, BL=32, PDL=True, AHEAD=True),
              q_types),
        "o": (mt._mla_o_absorb_kernel, dict(DV=128, L=512, BV=8, PDL=True, AHEAD=True), o_types),
        "q dot": (mt._mla_q_absorb_dot_kernel, {**q_dot, "BB": 64, "QSPLIT": False}, q_types),
        "q dot, fp32 q": (mt._mla_q_absorb_dot_kernel, {**q_dot, "BB": 16, "QSPLIT": True},
                          {**q_types, "q_ptr": "*fp32"}),
        "o dot": (mt._mla_o_absorb_dot_kernel,
                  dict(DV=128, L=512, BV=16, BK=64, BB=16, PDL=True, TC=True, FMA=False), o_types),
        "q fma": (mt._mla_q_absorb_dot_kernel, {**q_dot, "BB": 16, "QSPLIT": False, "FMA": True}, q_types),
        "o fma": (mt._mla_o_absorb_dot_kernel, dict(DV=128, L=512, BV=16, BK=64, BB=16, PDL=True, TC=True,
                                                     FMA=True), o_types),
    }[which]  # fmt: skip
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in params}
    src = ASTSource(kernel, sig, {(params.index(c),): v for c, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "griddepcontrol.wait" in ck.asm["ptx"]
    res, sass = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None, res
    assert int(use.group(2)) == 0, f"{use.group(1)} registers and {use.group(2)} bytes of stack"
    if "dot" in which:  # on the tensor cores: bf16 MMAs with fp32 accumulation
        assert re.search(r"HG?MMA\.[\dx]+\.F32\.BF16", sass), "no bf16 tensor-core MMA in the SASS"
    if "fma" in which:  # fp32 fused multiply-adds on the CUDA cores, no tensor-core MMA
        assert "FFMA" in sass and not re.search(r"HG?MMA", sass), "not an fp32 FMA dot"
