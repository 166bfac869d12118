"""In-place KDA decode: the fresh-state zeroing kernel against its torch oracle, and kda_decode_in_place
(states read and written in the cache pool) against kda_forward on gathered states.

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.kda import kda_backend, kda_decode_in_place, kda_forward
from k3run.kernels.kda.state import zero_fresh_states_ref
from k3run.knobs import reset_knobs
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child
from tests.kernels.test_kda_gpu import _raw_inputs

FLA_RTOL = 5e-3  # fla's own bound for bf16 inputs (see test_kda_gpu.py)


def _pool_case(device: str, S: int = 9, row: tuple[int, ...] = (3, 5, 11)):
    pool = torch.randn(S, *row, device=device)
    slots = torch.tensor([7, 2, 4, 0, 8], device=device)
    ctx = torch.tensor([3, 0, 12, 0, 1], device=device)
    return pool, slots, ctx


def _check_zeroed(pool: torch.Tensor, before: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor) -> None:
    fresh = set(slots[ctx == 0].tolist())
    for s in range(pool.shape[0]):
        if s in fresh:
            assert torch.count_nonzero(pool[s]) == 0, f"slot {s} (fresh) was not zeroed"
        else:
            assert torch.equal(pool[s], before[s]), f"slot {s} changed"


def test_zero_fresh_states_ref_zeroes_exactly_the_fresh_slots() -> None:
    pool, slots, ctx = _pool_case("cpu")
    before = pool.clone()
    zero_fresh_states_ref(pool, slots, ctx)
    _check_zeroed(pool, before, slots, ctx)


def test_zero_fresh_states_rejects_mismatched_inputs() -> None:
    pool, slots, ctx = _pool_case("cpu")
    with pytest.raises(ValueError, match="slots and context_lens"):
        zero_fresh_states_ref(pool, slots, ctx[:3])


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=2)


@interp_only
@pytest.mark.parametrize("block", [16, 64])
def test_interp_zero_fresh_states_kernel(block: int) -> None:
    # row of 165 elements: the last block of each row is partly masked at both block sizes
    from k3run.kernels.kda.state import zero_fresh_states_triton

    pool, slots, ctx = _pool_case("cpu")
    before = pool.clone()
    zero_fresh_states_triton(pool, slots, ctx, block=block)
    _check_zeroed(pool, before, slots, ctx)


def _in_place_vs_gathered(device: str, dtype: torch.dtype, H: int, K: int, V: int, conv_zeroes: bool = False):
    """kda_decode_in_place on a pool with stale slots vs kda_forward on the gathered (fresh: zero) states.
    conv_zeroes: the fresh slots are zeroed by the conv launch before it (`zero_pool`, as the layer does on
    CUDA) and the decode is told so (`fresh_zeroed`)."""
    B, S = 5, 9
    x = _raw_inputs(list(range(B + 1)), H, K, V, dtype, device)  # one token per sequence
    pool = torch.randn(S, H, K, V, device=device) * 0.5
    slots = torch.tensor([7, 2, 4, 0, 8], device=device)
    ctx = torch.tensor([3, 0, 12, 0, 1], device=device)  # rows 1 and 3 start fresh in stale slots
    h0 = torch.where((ctx != 0)[:, None, None, None], pool[slots], 0)
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, scale=K**-0.5)
    qkvfb = (x["q"], x["k"], x["v"], x["f"], x["b"])
    o_ref, ht_ref = kda_forward(
        *qkvfb, **gate, initial_state=h0, cu_seqlens=torch.arange(B + 1, device=device), decode=True
    )
    untouched = [s for s in range(S) if s not in slots.tolist()]
    before = pool[untouched].clone()
    if conv_zeroes:
        from k3run.kernels.kda import causal_conv1d_decode_in_place

        conv_pool = torch.randn(S, 3 * 16, 3, device=device, dtype=dtype)
        xc, wc = torch.randn(B, 3 * 16, device=device, dtype=dtype), torch.randn(3 * 16, 4, device=device)
        causal_conv1d_decode_in_place(
            xc, wc, conv_pool=conv_pool, slots=slots, context_lens=ctx, groups=3, zero_pool=pool
        )
    o = kda_decode_in_place(
        *qkvfb, **gate, state_pool=pool, slots=slots, context_lens=ctx, fresh_zeroed=conv_zeroes
    )
    return o, o_ref, pool[slots], ht_ref, pool[untouched], before


def test_cpu_in_place_decode_equals_gathered_states_bit_for_bit(monkeypatch) -> None:
    """Without the SIMD extension the reference runs on the gathered states: equal bit for bit."""
    monkeypatch.setenv("K3RUN_CPU_SIMD", "0")
    reset_knobs()
    o, o_ref, ht, ht_ref, untouched, before = _in_place_vs_gathered("cpu", torch.bfloat16, H=2, K=16, V=8)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref) and torch.equal(untouched, before)


@pytest.mark.parametrize("H, K, V", [(3, 48, 40), (2, 128, 128)])
def test_cpu_extension_decode_matches_gathered_states(monkeypatch, H, K, V) -> None:
    """cpu_simd.kda_decode_step (the states updated in place): the reference's products, its sums over K in
    another order and possibly fused multiply-adds, so the relative RMS difference is a few fp32 roundings
    of K-term sums: bound 4 K 2^-24. Untouched slots stay as they were; fresh rows start from zero."""
    import k3run.kernels.cpu_simd as cpu_simd

    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    if not cpu_simd.available():
        pytest.skip("the SIMD extension needs an AVX2 or AVX-512 CPU and a C++ compiler")
    o, o_ref, ht, ht_ref, untouched, before = _in_place_vs_gathered("cpu", torch.bfloat16, H=H, K=K, V=V)
    rtol = 4 * K * 2.0**-24
    assert_close("kda decode o", o_ref, o, rtol)
    assert_close("kda decode states", ht_ref, ht, rtol)
    assert torch.equal(untouched, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_zero_fresh_states_kernel() -> None:
    from k3run.kernels.kda.state import zero_fresh_states_triton

    pool, slots, ctx = _pool_case("cuda", S=11, row=(3, 129, 7))
    before = pool.clone()
    zero_fresh_states_triton(pool, slots, ctx)
    _check_zeroed(pool, before, slots, ctx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("conv_zeroes", [False, True])
def test_gpu_in_place_decode_matches_gathered_states(conv_zeroes: bool) -> None:
    # fla in place vs fla on gathered states: same kernel arithmetic, so equal up to fla's bf16 bound; with
    # conv_zeroes the fresh states were zeroed by the conv launch (the layer's CUDA path), not by the decode
    assert kda_backend("cuda") == "fla", "fla-core must be installed on the GPU machine (the gpu extra)"
    from k3run.kernels.kda.fla import _fused_recurrent_fwd

    assert _fused_recurrent_fwd() is not None, "this fla-core has no in-place decode"
    o, o_ref, ht, ht_ref, untouched, before = _in_place_vs_gathered(
        "cuda", torch.bfloat16, H=3, K=128, V=128, conv_zeroes=conv_zeroes
    )
    assert_close("o", o_ref, o, FLA_RTOL)
    assert_close("final state", ht_ref, ht, FLA_RTOL)
    assert torch.equal(untouched, before)


@pytest.mark.parametrize("H, K, V", [(3, 48, 40), (2, 128, 128)])
def test_cpu_extension_prefill_matches_the_recurrent_reference(monkeypatch, H, K, V) -> None:
    """cpu_simd.kda_prefill_recurrent through chunk_kda (varlen prompts of 0, 1, 17 and 50 tokens, random
    initial states) against recurrent_kda_ref: the reference's products and its sums over K in another
    order, carried through each prompt's state, so the bound is the decode step's (4 K 2^-24 relative RMS)
    times the longest prompt. The initial states are not modified."""
    import k3run.kernels.cpu_simd as cpu_simd
    from k3run.kernels.kda import chunk_kda, l2norm, recurrent_kda_ref

    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    if not cpu_simd.available():
        pytest.skip("the SIMD extension needs an AVX2 or AVX-512 CPU and a C++ compiler")
    g = torch.Generator().manual_seed(5)
    lens = [17, 0, 1, 50]
    cu = torch.tensor([0] + lens).cumsum(0)
    T, B = int(cu[-1]), len(lens)
    q = l2norm(torch.randn(T, H, K, generator=g))
    k = l2norm(torch.randn(T, H, K, generator=g))
    v = torch.randn(T, H, V, generator=g)
    lg = -torch.rand(T, H, K, generator=g) * 0.5  # log decay in (-0.5, 0]
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    h0 = torch.randn(B, H, K, V, generator=g) * 0.3
    before = h0.clone()
    o_ref, ht_ref = recurrent_kda_ref(q, k, v, lg, beta, K**-0.5, h0, cu)
    o, ht = chunk_kda(q, k, v, lg, beta, scale=K**-0.5, initial_state=h0, cu_seqlens=cu)
    rtol = 4 * K * 2.0**-24 * max(lens)
    assert_close("kda prefill o", o_ref, o, rtol)
    assert_close("kda prefill states", ht_ref, ht, rtol)
    assert torch.equal(ht[1], h0[1])  # the empty prompt keeps its state
    assert torch.equal(h0, before)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cpu_simd.kda_prefill_recurrent(q, k, v, lg.exp(), beta, h0.clone(), torch.tensor([0, 5, 3, 60, T]))


def test_batched_decode_step_equals_the_per_sequence_reference() -> None:
    """recurrent_kda_step_batched (the compiled CPU step's KDA: every sequence's one token at once, so the
    batch stays symbolic) against recurrent_kda_seq run per sequence, on odd sizes. Both run the same fp32
    products; the batched einsums may sum over K in another order: fp32 rounding, RTOL[fp32] per element
    scaled by the K-term sums' magnitude (assert_close's relative measure)."""
    from k3run.kernels.kda.ref import recurrent_kda_seq, recurrent_kda_step_batched
    from k3run.testing import RTOL

    g = torch.Generator().manual_seed(5)
    B, H, K, V = 5, 3, 13, 11
    q, k = torch.randn(B, H, K, generator=g), torch.randn(B, H, K, generator=g)
    v = torch.randn(B, H, V, generator=g)
    lg = -torch.rand(B, H, K, generator=g)  # log decay <= 0
    beta = torch.rand(B, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g)
    o, new = recurrent_kda_step_batched(q, k, v, lg, beta, K**-0.5, state)
    for b in range(B):
        o_b, s_b = recurrent_kda_seq(q[b : b + 1], k[b : b + 1], v[b : b + 1], lg[b : b + 1], beta[b : b + 1],
                                     K**-0.5, state[b])  # fmt: skip
        assert_close(f"o[{b}]", o_b[0], o[b], rtol=RTOL[torch.float32])
        assert_close(f"state[{b}]", s_b, new[b], rtol=RTOL[torch.float32])
    o0, s0 = recurrent_kda_step_batched(q, k, v, lg, beta, K**-0.5, None)  # no state: zeros
    o1, s1 = recurrent_kda_step_batched(q, k, v, lg, beta, K**-0.5, torch.zeros_like(state))
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
