"""KDA's short conv kernels against the torch reference: the decode conv with the states in the cache
(gather the windows, causal_conv1d_decode_ref, scatter: fresh and stale slots), and the varlen prefill conv
(causal_conv1d_ref: sequences shorter than the window, an empty one, with and without initial states); both
on a strided input with planar output.

Error bound: both compute the same fp32 multiply-adds in the same order; the kernel may contract a multiply
and an add into one FMA and writes SiLU as acc / (1 + exp(-acc)), so fp32 outputs differ by a few fp32
roundings (relative RMS <= 1e-6) and 16-bit outputs by at most one output ulp where the fp32 value sits
next to a rounding midpoint (<= 2^-11 for fp16, 2^-8 for bf16). The new states are copies of inputs: exact.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.kda import causal_conv1d_decode_in_place, causal_conv1d_planar
from k3run.kernels.kda.ref import causal_conv1d_decode_ref, causal_conv1d_ref
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

RTOL = {torch.float32: 1e-6, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
S, W = 7, 4


def _case(dtype: torch.dtype, device: str, P: int = 37, B: int = 5):
    C = 3 * P
    wide = torch.randn(B, C + 29).to(dtype).to(device)  # q | k | v are the first 3P columns of a wider row
    x = wide[:, :C]
    weight = torch.randn(C, W).to(device)
    pool = torch.randn(S, C, W - 1).to(dtype).to(device)
    slots = torch.tensor([4, 0, 6, 2, 5][:B], device=device)
    ctx = torch.tensor([3, 0, 9, 1, 0][:B], device=device)  # rows 1 and 4 start fresh in stale slots
    return x, weight, pool, slots, ctx


def _expected(x, weight, pool, slots, ctx, groups: int):
    """The pre-kernel layer path: gather, zero the fresh rows, the batched reference, scatter."""
    B, C = x.shape
    state = torch.where((ctx != 0)[:, None, None], pool[slots], 0)
    y, final = causal_conv1d_decode_ref(x, weight, state)
    new_pool = pool.clone()
    new_pool[slots] = final
    return y.reshape(B, groups, C // groups).transpose(0, 1), new_pool


def _check(dtype: torch.dtype, device: str, triton_kernel: bool, block_c: int = 64) -> None:
    x, weight, pool, slots, ctx = _case(dtype, device)
    y_ref, pool_ref = _expected(x, weight, pool, slots, ctx, groups=3)
    if triton_kernel:
        from k3run.kernels.kda.conv import causal_conv1d_decode_in_place_triton

        y = causal_conv1d_decode_in_place_triton(x, weight, pool, slots, ctx, groups=3, block_c=block_c)
    else:
        y = causal_conv1d_decode_in_place(x, weight, conv_pool=pool, slots=slots, context_lens=ctx, groups=3)
    assert y.shape == (3, x.shape[0], x.shape[1] // 3) and y.dtype == dtype and y[1].is_contiguous()
    assert_close("conv decode y", y_ref.float(), y.float(), RTOL[dtype])
    assert torch.equal(pool, pool_ref), "new windows (and untouched slots) must be exact"


def _check_zero_pool(device: str, triton_kernel: bool) -> None:
    """zero_pool: the same launch zeroes the recurrent states of the fresh rows' slots (rows 1 and 4: slots
    0 and 5) and touches no other slot; the conv's output and windows are as without it. The state rows
    (3 x 50 x 50 = 7500 fp32) are not a multiple of the zeroing block and are split over the row's
    programs (111 channels in blocks of 64: two)."""
    x, weight, pool, slots, ctx = _case(torch.float32, device)
    y_ref, pool_ref = _expected(x, weight, pool, slots, ctx, groups=3)
    rec = torch.randn(S, 3, 50, 50, device=device)
    rec_ref = rec.clone()
    rec_ref[[0, 5]] = 0
    if triton_kernel:
        from k3run.kernels.kda.conv import causal_conv1d_decode_in_place_triton

        y = causal_conv1d_decode_in_place_triton(
            x, weight, pool, slots, ctx, groups=3, block_c=64, zero_pool=rec
        )
    else:
        y = causal_conv1d_decode_in_place(
            x, weight, conv_pool=pool, slots=slots, context_lens=ctx, groups=3, zero_pool=rec
        )
    assert_close("conv decode y", y_ref, y, RTOL[torch.float32])
    assert torch.equal(pool, pool_ref) and torch.equal(rec, rec_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_dispatch_is_the_reference_bit_for_bit(dtype: torch.dtype, monkeypatch) -> None:
    """On x86 with the SIMD extension the in-place kernel runs (counted) and gives the reference's bits: the
    same fp32 products and sums in the same order, no fused multiply-adds."""
    from k3run.kernels import cpu_simd

    calls = []
    if cpu_simd.available():
        real = cpu_simd.conv_decode_in_place
        monkeypatch.setattr(cpu_simd, "conv_decode_in_place", lambda *a: calls.append(1) or real(*a))
    x, weight, pool, slots, ctx = _case(dtype, "cpu")
    y_ref, pool_ref = _expected(x, weight, pool, slots, ctx, groups=3)
    y = causal_conv1d_decode_in_place(x, weight, conv_pool=pool, slots=slots, context_lens=ctx, groups=3)
    assert torch.equal(y, y_ref) and torch.equal(pool, pool_ref)
    assert len(calls) == (1 if cpu_simd.available() else 0)


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=7)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_conv_decode_in_place(dtype: torch.dtype) -> None:
    _check(dtype, "cpu", triton_kernel=True)  # 111 channels in blocks of 64: the second block is masked


@interp_only
def test_interp_conv_decode_zeroes_fresh_recurrent_states() -> None:
    _check_zero_pool("cpu", triton_kernel=True)


def test_zero_pool_is_for_the_cuda_kernel_only() -> None:
    x, weight, pool, slots, ctx = _case(torch.float32, "cpu")
    with pytest.raises(ValueError, match="zero_pool is for the CUDA kernel only"):
        causal_conv1d_decode_in_place(
            x, weight, conv_pool=pool, slots=slots, context_lens=ctx, zero_pool=torch.zeros(S, 4)
        )


def test_adjacent_columns_is_a_view_of_the_merged_projection() -> None:
    from k3run.layers.kda import _adjacent_columns

    y = torch.randn(3, 20)
    q, k, v, rest = torch.split(y, [4, 4, 4, 8], dim=-1)
    qkv = _adjacent_columns(q, k, v)
    assert qkv.data_ptr() == y.data_ptr() and torch.equal(qkv, y[:, :12])
    swapped = _adjacent_columns(k, q, v)  # not in storage order: a copy with the right values
    assert torch.equal(swapped, torch.cat([k, q, v], dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_conv_decode_in_place(dtype: torch.dtype) -> None:
    _check(dtype, "cuda", triton_kernel=False)  # the dispatcher picks the kernel on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_conv_decode_zeroes_fresh_recurrent_states() -> None:
    _check_zero_pool("cuda", triton_kernel=False)


LENGTHS = [1, 2, 0, 5, 23, 9]  # shorter than the window, empty, and several blocks of tokens


def _check_varlen(dtype: torch.dtype, device: str, with_state: bool, triton_kernel: bool) -> None:
    g = torch.Generator().manual_seed(5)
    P, B = 37, len(LENGTHS)
    C, T = 3 * P, sum(LENGTHS)
    wide = torch.randn(T, C + 29, generator=g).to(dtype).to(device)  # q | k | v: the first 3P columns
    x = wide[:, :C]
    weight = torch.randn(C, W, generator=g).to(device)
    state = torch.randn(B, C, W - 1, generator=g).to(dtype).to(device) if with_state else None
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=device)
    y_ref, final_ref = causal_conv1d_ref(
        x.cpu(), weight.cpu(), cu.cpu(), None if state is None else state.cpu()
    )
    if triton_kernel:
        from k3run.kernels.kda.conv import causal_conv1d_varlen_triton

        y, final = causal_conv1d_varlen_triton(x, weight, cu, state, groups=3, block_t=8, block_c=64)
    else:
        y, final = causal_conv1d_planar(x, weight, cu_seqlens=cu, initial_state=state, groups=3)
    assert y.shape == (3, T, P) and y.dtype == dtype and y[2].is_contiguous()
    want = y_ref.reshape(T, 3, P).transpose(0, 1)
    assert_close("conv varlen y", want.float(), y.float().cpu(), RTOL[dtype])
    assert torch.equal(final.cpu(), final_ref), "new windows are copies of inputs: exact"


@pytest.mark.parametrize(("dtype", "with_state"), [(torch.bfloat16, True), (torch.float32, False),
                                                  (torch.float32, True)])  # fmt: skip
def test_cpu_planar_conv_matches_the_reference(dtype: torch.dtype, with_state: bool, monkeypatch) -> None:
    """On x86 with the SIMD extension the prompt conv's sums run there (counted): the reference's products
    and additions in its order, so the pre-SiLU sums are its bits; the SiLU runs in torch over another
    layout, whose vectorised and scalar forms may round an element 1 ulp apart (RTOL above); the new
    windows are copies: exact."""
    from k3run.kernels import cpu_simd

    calls = []
    if cpu_simd.available():
        real = cpu_simd.conv_prefill
        monkeypatch.setattr(cpu_simd, "conv_prefill", lambda *a: calls.append(1) or real(*a))
    _check_varlen(dtype, "cpu", with_state=with_state, triton_kernel=False)
    assert len(calls) == (1 if cpu_simd.available() else 0)


def test_cpu_prompt_conv_sums_are_the_references() -> None:
    """cpu_simd.conv_prefill's fp32 sums against the reference's formula (window = state | inputs, acc +=
    w[:, j] * window[:, j : j + n] for j ascending) per sequence: every bit equal."""
    from k3run.kernels import cpu_simd

    if not cpu_simd.available():
        pytest.skip("no SIMD extension on this machine")
    g = torch.Generator().manual_seed(2)
    C, B = 45, len(LENGTHS)
    T = sum(LENGTHS)
    x = torch.randn(T, C, generator=g).to(torch.bfloat16)
    weight = torch.randn(C, W, generator=g)
    state = torch.randn(B, C, W - 1, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    acc, _ = cpu_simd.conv_prefill(x, weight, cu, state)
    for b in range(B):
        s, e = int(cu[b]), int(cu[b + 1])
        window = torch.cat([state[b], x[s:e].transpose(0, 1)], dim=1)
        want = torch.zeros(C, e - s)
        for j in range(W):
            want += weight[:, j : j + 1] * window[:, j : j + e - s].float()
        assert torch.equal(acc[s:e], want.transpose(0, 1)), b
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0"):
        cpu_simd.conv_prefill(x, weight, cu[:-1], state[:-1])


@interp_only
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_conv_varlen(dtype: torch.dtype, with_state: bool) -> None:
    _check_varlen(
        dtype, "cpu", with_state, triton_kernel=True
    )  # 48 tokens in blocks of 8, 111 channels in 64s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_conv_varlen(dtype: torch.dtype, with_state: bool) -> None:
    _check_varlen(dtype, "cuda", with_state, triton_kernel=False)  # the dispatcher picks the kernel on CUDA
