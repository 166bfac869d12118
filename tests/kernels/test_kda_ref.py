"""KDA oracle vs fla-core's naive references, chunked vs recurrent, and the short conv with states."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from k3run.kernels.kda import causal_conv1d, causal_conv1d_decode, chunk_kda, kda_gate, l2norm, recurrent_kda
from k3run.testing import RTOL, assert_close, noise_floor_rtol

# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32 everywhere below. The gate, conv and recurrent forms take O(K) roundings per output on O(1) values
# (relative RMS ~ sqrt(K) u ~ 3e-7 at K = 20, u = 2^-24), so 1e-5 is a >= 30x margin. The chunked forms
# also solve a triangular system per chunk, whose conditioning amplifies the roundings by an amount that
# depends on the data: those are bounded by fla's own fp32 chunk error against an fp64 recurrence instead
# (noise_floor_rtol).


def _recurrent_fp64(q, k, v, g, beta, scale: float, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence, straight from its definition, in fp64: the truth the chunked forms approximate."""
    S = h0.double().clone()  # [H, K, V]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        pred = (k[t][..., None] * S).sum(-2)  # [H, V]
        S = S + (beta[t][:, None] * k[t])[..., None] * (v[t] - pred)[:, None, :]
        o[t] = ((q[t] * scale)[..., None] * S).sum(-2)
    return o, S


def _fla_file(rel: str) -> Path:
    spec = importlib.util.find_spec("fla")
    assert spec is not None and spec.submodule_search_locations, (
        "fla-core (a dev dependency) is not installed"
    )
    return Path(spec.submodule_search_locations[0]) / rel


@pytest.fixture(scope="module")
def fla_naive() -> ModuleType:
    # naive.py is pure torch + einops; loading the file alone avoids importing fla's Triton ops
    spec = importlib.util.spec_from_file_location("fla_kda_naive", _fla_file("ops/kda/naive.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fla_gate() -> ModuleType:
    # gate.py imports triton at module level, so it goes through the package (works on CPU, ~5 s)
    import fla.ops.kda.gate as gate

    return gate


def _inputs(T: int, H: int, K: int, V: int, lower_bound: float | None) -> tuple[torch.Tensor, ...]:
    q = l2norm(torch.randn(T, H, K))
    k = l2norm(torch.randn(T, H, K))
    v = torch.randn(T, H, V)
    f = torch.randn(T, H, K) * 2
    A_log = torch.randn(H) * 0.5
    dt_bias = torch.randn(H * K)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(torch.randn(T, H))
    return q, k, v, g, beta


def test_softplus_gate_matches_fla(fla_gate: ModuleType) -> None:
    H, K = 3, 10
    f = torch.randn(5, 7, H, K) * 8  # reaches the softplus threshold region z > 20
    f[0, 0, 0, :3] = torch.tensor([25.0, 19.9, -30.0])
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    ref = fla_gate.naive_kda_gate(f, A_log, dt_bias)
    out = kda_gate(f, A_log, dt_bias, lower_bound=None)
    assert out.dtype == torch.float32
    assert_close("softplus gate", ref, out, rtol=RTOL[torch.float32])
    assert (out < 0).all()


def test_lowerbound_gate_matches_fla(fla_gate: ModuleType) -> None:
    H, K = 4, 6
    f = torch.randn(9, H, K) * 3
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    ref = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0)
    out = kda_gate(f.bfloat16(), A_log, dt_bias, lower_bound=-5.0)  # bf16 f is promoted, g stays fp32
    assert_close(
        "lower-bound gate", fla_gate.naive_kda_lowerbound_gate(f.bfloat16(), A_log, dt_bias), out, 1e-6
    )
    assert_close("lower-bound gate fp32", ref, kda_gate(f, A_log, dt_bias, -5.0), rtol=RTOL[torch.float32])
    assert ((out > -5.0) & (out < 0)).all()


def test_gate_rejects_wrong_parameter_sizes() -> None:
    with pytest.raises(ValueError, match="A_log must have H=2"):
        kda_gate(torch.randn(3, 2, 4), torch.randn(3), torch.randn(8), None)
    with pytest.raises(ValueError, match="dt_bias must have H\\*K=8"):
        kda_gate(torch.randn(3, 2, 4), torch.randn(2), torch.randn(4), -5.0)


def test_l2norm_eps_inside_sqrt() -> None:
    x = torch.randn(6, 2, 16)
    x[0, 0] = 1e-4  # tiny vector: sum(x^2) = 1.6e-7 is comparable to eps
    ref = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    assert_close("l2norm", ref, l2norm(x), rtol=1e-6)
    # F.normalize clamps the norm instead; it would map the tiny vector to unit length
    assert (l2norm(x)[0, 0].norm() - 1).abs() > 0.5
    assert (F.normalize(x, dim=-1, eps=1e-6)[0, 0].norm() - 1).abs() < 1e-5


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_recurrent_matches_fla_naive_varlen(fla_naive: ModuleType, lower_bound: float | None) -> None:
    H, K, V = 3, 20, 12
    lens = [9, 1, 23]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta = _inputs(int(cu[-1]), H, K, V, lower_bound)
    h0 = torch.randn(len(lens), H, K, V)
    scale = K**-0.5
    o, ht = recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu)
    for b in range(len(lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        o_ref, ht_ref = fla_naive.naive_recurrent_kda(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            scale=scale, initial_state=h0[b : b + 1], output_final_state=True,
        )  # fmt: skip
        assert_close(f"o[{b}]", o_ref[0], o[s:e], rtol=RTOL[torch.float32])
        assert_close(f"state[{b}]", ht_ref[0], ht[b], rtol=RTOL[torch.float32])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_matches_fla_naive_chunk(fla_naive: ModuleType, lower_bound: float | None) -> None:
    H, K, V, T = 2, 16, 8, 128  # fla's naive chunk needs T % 64 == 0
    q, k, v, g, beta = _inputs(T, H, K, V, lower_bound)
    h0 = torch.randn(1, H, K, V)
    cu = torch.tensor([0, T])
    o, ht = chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cu)
    o_ref, ht_ref = fla_naive.naive_chunk_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=0.3, initial_state=h0, output_final_state=True
    )
    o64, h64 = _recurrent_fp64(q, k, v, g, beta, 0.3, h0[0])
    assert_close("chunk o vs fp64", o64, o, rtol=noise_floor_rtol(o64, o_ref[0]))
    assert_close("chunk state vs fp64", h64, ht[0], rtol=noise_floor_rtol(h64, ht_ref[0]))
    assert_close("chunk o vs fla", o_ref[0], o, rtol=2 * noise_floor_rtol(o64, o_ref[0]))


def test_chunk_equals_recurrent_odd_lengths_strong_decay() -> None:
    H, K, V = 2, 12, 10
    lens = [130, 1, 64, 5]  # a partial last chunk, a single token, whole chunks (CHUNK_SIZE 16 or 64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, _, beta = _inputs(int(cu[-1]), H, K, V, None)
    # decays near the K3 bound: the cumulative log decay over a chunk reaches about -320, where exp(-G)
    # would overflow fp32; only differences G_i - G_j (j <= i) may be exponentiated
    g = -5.0 * torch.sigmoid(torch.randn(int(cu[-1]), H, K) + 4)
    h0 = torch.randn(len(lens), H, K, V)
    o_r, ht_r = recurrent_kda(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, cu_seqlens=cu)
    o_c, ht_c = chunk_kda(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, cu_seqlens=cu)
    assert torch.isfinite(o_c).all() and torch.isfinite(ht_c).all()
    assert_close("chunk vs recurrent o", o_r, o_c, rtol=RTOL[torch.float32])
    assert_close("chunk vs recurrent state", ht_r, ht_c, rtol=RTOL[torch.float32])


def test_split_prefill_continues_from_state() -> None:
    H, K, V, T, cut = 2, 8, 8, 90, 70
    q, k, v, g, beta = _inputs(T, H, K, V, -5.0)
    full_o, full_h = chunk_kda(
        q, k, v, g, beta, scale=0.5, initial_state=None, cu_seqlens=torch.tensor([0, T])
    )
    o1, h1 = chunk_kda(
        q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], scale=0.5, initial_state=None,
        cu_seqlens=torch.tensor([0, cut]),
    )  # fmt: skip
    o2, h2 = recurrent_kda(
        q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], scale=0.5, initial_state=h1,
        cu_seqlens=torch.tensor([0, T - cut]),
    )  # fmt: skip
    assert_close("split o", full_o, torch.cat([o1, o2]), rtol=RTOL[torch.float32])
    assert_close("split state", full_h, h2, rtol=RTOL[torch.float32])
    assert full_o.abs().mean() > 1e-2  # not a degenerate all-zero comparison


def test_kda_rejects_bad_shapes() -> None:
    q = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="beta must have shape"):
        chunk_kda(
            q, q, q, q, torch.rand(5, 3), scale=1.0, initial_state=None, cu_seqlens=torch.tensor([0, 5])
        )
    with pytest.raises(ValueError, match="initial_state must have shape"):
        recurrent_kda(
            q, q, q, q, torch.rand(5, 2), scale=1.0, initial_state=torch.zeros(2, 2, 4, 4),
            cu_seqlens=torch.tensor([0, 5]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T=5"):
        chunk_kda(
            q, q, q, q, torch.rand(5, 2), scale=1.0, initial_state=None, cu_seqlens=torch.tensor([0, 4])
        )


def _conv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Whole-sequence causal depthwise conv via F.conv1d with left zero padding, then SiLU."""
    C, W = weight.shape
    y = F.conv1d(x.double().t()[None], weight.double()[:, None, :], padding=W - 1, groups=C)[
        0, :, : x.shape[0]
    ]
    return F.silu(y).t()


def test_conv_matches_conv1d_and_continues_from_state() -> None:
    C, W = 11, 4
    weight = torch.randn(C, W)
    lens = [7, 2, 13]
    xs = [torch.randn(n, C) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, st = causal_conv1d(torch.cat(xs), weight, cu_seqlens=cu, initial_state=None)
    for b, x in enumerate(xs):
        assert_close(
            f"conv seq {b}", _conv_ref(x, weight), y[int(cu[b]) : int(cu[b + 1])], rtol=RTOL[torch.float32]
        )
    # the state is the last W-1 inputs, zero-padded on the left for a sequence shorter than W-1
    assert torch.equal(st[0], xs[0][-3:].t())
    assert torch.equal(st[1], torch.cat([torch.zeros(C, 1), xs[1].t()], dim=1))

    # continuing each sequence with a second piece (1, 5 and 2 tokens) equals the conv of the concatenation
    more = [torch.randn(n, C) for n in (1, 5, 2)]
    cu2 = torch.tensor([0, 1, 6, 8])
    y2, st2 = causal_conv1d(torch.cat(more), weight, cu_seqlens=cu2, initial_state=st)
    for b in range(3):
        full = torch.cat([xs[b], more[b]])
        ref = _conv_ref(full, weight)[lens[b] :]
        assert_close(f"conv continued {b}", ref, y2[int(cu2[b]) : int(cu2[b + 1])], rtol=RTOL[torch.float32])
        assert torch.equal(st2[b], full[-3:].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_is_the_varlen_conv(dtype: torch.dtype) -> None:
    """The batched one-token-per-sequence conv (decode steps, no host read of cu_seqlens) does the same fp32
    products and sums per element as the varlen reference; only SiLU may differ in the last bit (torch's
    vectorised and scalar exp), so the outputs agree to 2^-22 relative in fp32, to one bf16 rounding
    (2^-8) in bf16; the states are copies: equal. None means fresh states."""
    C, W, B = 13, 4, 5
    weight = torch.randn(C, W)
    x = torch.randn(B, C).to(dtype)
    state = torch.randn(B, C, W - 1).to(dtype)
    for init in (state, None):
        want = causal_conv1d(x, weight, cu_seqlens=torch.arange(B + 1), initial_state=init)
        got = causal_conv1d_decode(x, weight, initial_state=init)
        assert_close("conv decode", want[0], got[0], rtol=2**-22 if dtype == torch.float32 else 2**-8)
        assert torch.equal(want[1], got[1])
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_decode(x, weight, initial_state=state[:, :, :2])


def test_conv_bf16_keeps_dtype() -> None:
    C, W = 16, 4
    weight = torch.randn(C, W)
    x = torch.randn(10, C).bfloat16()
    y, st = causal_conv1d(x, weight, cu_seqlens=torch.tensor([0, 10]), initial_state=None)
    assert y.dtype == torch.bfloat16 and st.dtype == torch.bfloat16
    # fp32 accumulation, one final rounding to bf16 (8 mantissa bits): <= 2^-9 relative per element
    assert_close("conv bf16", _conv_ref(x.float(), weight), y, rtol=2**-9)
