"""The CPU absorbed MLA decode attention (cpu_simd.mla_decode) against the fp32 reference of the same bf16
latents, at both instruction sets, and the MLA layer's eager decode taking it.

Bound: bf16 -> fp32 is exact, so both form the same exact fp32 products: the scores differ by J-term fp32
sums in another order (~sqrt(J) 2^-24 relative), the softmax by the chunks' online rescaling (a few fp32
roundings of exp), and the output by N-term weighted sums in another order; relative RMS bound 64 2^-24
(~4e-6) for the unit-scale data here, N <= 1100.
"""

from __future__ import annotations

import pytest
import torch

import k3run.kernels.cpu_simd as cpu_simd
from k3run.knobs import override_knobs, reset_knobs
from k3run.testing import assert_close
from tests.kernels.cpu_paths import needs_simd

BOUND = 64 * 2.0**-24


def _ref(q: torch.Tensor, lat: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    c = lat.float()
    return torch.softmax((q @ c.T) * scale, dim=-1) @ c[:, :L]


@needs_simd
@pytest.mark.parametrize("level", ["avx512", "avx2"])
@pytest.mark.parametrize(
    "h, j, L, n", [(3, 48, 32, 1), (5, 96, 64, 7), (32, 576, 512, 301), (7, 80, 48, 1100)]
)
def test_mla_decode_matches_the_fp32_reference(
    monkeypatch, level: str, h: int, j: int, L: int, n: int
) -> None:
    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    if level == "avx512" and cpu_simd.cpu_level() != "avx512":
        pytest.skip("no AVX-512 on this CPU")
    g = torch.Generator().manual_seed(h * 1000 + n)
    store = torch.randn(n + 5, j, generator=g).bfloat16()
    lat = store[3 : n + 3]  # a slice of a larger cache: the rows read in place
    q = torch.randn(h, j, generator=g) / j**0.25
    with override_knobs(cpu_simd=level if level == "avx2" else None):
        assert cpu_simd.mla_decode_applies(q, lat, L)
        got = cpu_simd.mla_decode(q, lat, L, 0.3)
    assert got.shape == (h, L) and got.dtype == torch.float32
    assert_close(f"mla decode ({level})", _ref(q, lat, L, 0.3), got, BOUND)


@needs_simd
def test_mla_decode_merges_chunks_with_far_apart_maxima(monkeypatch) -> None:
    # many chunks (MLA_MIN_CHUNK forced small), one row far above the rest: every other chunk's weight
    # underflows against it and the output is that row's latent
    monkeypatch.setattr(cpu_simd, "MLA_MIN_CHUNK", 16)
    if not cpu_simd.available():
        pytest.skip("the SIMD extension did not build")
    lat = torch.randn(200, 64).bfloat16()
    q = torch.zeros(2, 64)
    q[:, 0] = 1.0
    lat[137, 0] = 300.0
    got = cpu_simd.mla_decode(q, lat, 48, 1.0)
    assert torch.equal(got, lat[137, :48].float().expand(2, -1))
    assert_close("mla decode, many chunks", _ref(q, lat, 48, 1.0), got, BOUND)


def test_mla_decode_does_not_apply_outside_its_cases() -> None:
    lat = torch.randn(10, 64).bfloat16()
    q = torch.randn(2, 64)
    assert not cpu_simd.mla_decode_applies(q, lat.float(), 48)  # fp32 latents: torch's path
    assert not cpu_simd.mla_decode_applies(q, lat[:, :60], 48)  # width not a multiple of 16
    assert not cpu_simd.mla_decode_applies(q, lat, 40)  # L not a multiple of 16
    assert not cpu_simd.mla_decode_applies(q[:, :48], lat, 48)  # q and the rows of different widths


@needs_simd
def test_layer_eager_decode_takes_the_kernel_for_bf16_latents(monkeypatch) -> None:
    """KimiMLA._attend_absorbed: a decode query (one row at the last position) over bf16 cached latents
    runs cpu_simd.mla_decode; a prefill chunk (two rows) and fp32 latents run torch's path. The two paths
    agree within BOUND on the attention (W_UV's product after is the same in both)."""
    import types

    import k3run.layers.mla as mla

    if not cpu_simd.available():
        pytest.skip("the SIMD extension did not build")
    H, DN, L, R, DV, N = 4, 16, 32, 16, 16, 70
    g = torch.Generator().manual_seed(0)
    layer = types.SimpleNamespace(
        w_uk=torch.randn(H, DN, L, generator=g), w_uv=torch.randn(H, DV, L, generator=g), qk_nope_head_dim=DN,
        kv_lora_rank=L, scale=0.2, prefix="mla", _causal_softmax=mla.KimiMLA._causal_softmax,
    )  # fmt: skip
    lat = torch.randn(N, L + R, generator=g).bfloat16()
    q = torch.randn(1, H, DN + R, generator=g).bfloat16()
    ctx = types.SimpleNamespace(bounds=lambda: [0, 1], context_lens_list=[N - 1])
    calls = []
    real = mla.mla_decode_cpu
    monkeypatch.setattr(mla, "mla_decode_cpu", lambda *a: calls.append(1) or real(*a))
    got = mla.KimiMLA._attend_absorbed(layer, q, [lat], ctx)[0]
    assert calls == [1]
    monkeypatch.setattr(mla, "mla_decode_applies", lambda *a: False)
    want = mla.KimiMLA._attend_absorbed(layer, q, [lat], ctx)[0]
    assert calls == [1]
    assert_close("eager absorbed decode, kernel against torch", want, got, BOUND)
