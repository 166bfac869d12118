"""KDA dispatch: fla-core's Triton kernels on CUDA against the fp32 reference; the CPU path unchanged.

Error bound for the GPU tests: fla's own KDA tests accept a relative RMS error of 5e-3 for o and the final
state with fp16/bf16 inputs (its kernels keep intermediates such as the UT-transformed keys and the chunk
states in the input dtype: bf16 has 8 significant bits, one rounding <= 2^-9 = 2e-3 relative, and a few of
them compound). The reference here runs in fp32 on the same 16-bit-rounded inputs, so input rounding is not
part of the error.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from k3run.kernels.kda import (
    chunk_kda,
    kda_backend,
    kda_forward,
    kda_gate,
    l2norm,
    recurrent_kda,
)
from k3run.kernels.kda.fla import fla_kda_ops
from k3run.kernels.kda.ref import chunk_kda_ref, recurrent_kda_ref
from k3run.testing import assert_close

FLA_RTOL = 5e-3
GATES = [pytest.param(-5.0, id="lower_bound-5"), pytest.param(None, id="softplus")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _raw_inputs(
    cu: list[int], H: int, K: int, V: int, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """Raw layer tensors as the layer produces them (16-bit activations, fp32 gate parameters)."""
    T, B = cu[-1], len(cu) - 1
    return {
        "q": torch.randn(T, H, K).to(dtype).to(device),
        "k": torch.randn(T, H, K).to(dtype).to(device),
        "v": torch.randn(T, H, V).to(dtype).to(device),
        "f": (torch.randn(T, H, K) * 2).to(dtype).to(device),
        "b": torch.randn(T, H).to(dtype).to(device),
        "A_log": (torch.randn(H) * 0.5).to(device),
        "dt_bias": torch.randn(H * K).to(device),
        "h0": (torch.randn(B, H, K, V) * 0.5).to(device),
        "cu": torch.tensor(cu, dtype=torch.int64, device=device),
    }


def _reference(
    x: dict[str, torch.Tensor], lower_bound: float | None, decode: bool
) -> tuple[torch.Tensor, ...]:
    """The fp32 oracle on CPU copies of the same (16-bit-rounded) inputs."""
    c = {n: t.cpu() for n, t in x.items()}
    g = kda_gate(c["f"], c["A_log"], c["dt_bias"], lower_bound)
    beta = torch.sigmoid(c["b"].float())
    K = c["q"].shape[-1]
    ref = recurrent_kda_ref if decode else chunk_kda_ref
    return ref(l2norm(c["q"]), l2norm(c["k"]), c["v"].float(), g, beta, K**-0.5, c["h0"], c["cu"])


def _forward(
    x: dict[str, torch.Tensor], lower_bound: float | None, decode: bool, host_offsets: bool = False
) -> tuple[torch.Tensor, ...]:
    K = x["q"].shape[-1]
    return kda_forward(
        x["q"],
        x["k"],
        x["v"],
        x["f"],
        x["b"],
        A_log=x["A_log"],
        dt_bias=x["dt_bias"],
        lower_bound=lower_bound,
        scale=K**-0.5,
        initial_state=x["h0"],
        cu_seqlens=x["cu"],
        decode=decode,
        cu_seqlens_cpu=x["cu"].cpu() if host_offsets else None,
    )


# CPU: the dispatch keeps today's reference results bit for bit


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "recurrent"])
def test_cpu_kda_forward_is_the_layer_reference_bit_for_bit(lower_bound: float | None, decode: bool) -> None:
    cu = [0, 1, 2, 3] if decode else [0, 5, 21]
    x = _raw_inputs(cu, H=2, K=16, V=8, dtype=torch.bfloat16, device="cpu")
    assert kda_backend("cpu") == "ref"
    o, ht = _forward(x, lower_bound, decode)
    # what layers/kda.py computed before the dispatch took raw inputs
    q, k = l2norm(x["q"]), l2norm(x["k"])
    g = kda_gate(x["f"], x["A_log"], x["dt_bias"], lower_bound)
    beta = torch.sigmoid(x["b"].float())
    kda = recurrent_kda if decode else chunk_kda
    o_ref, ht_ref = kda(q, k, x["v"], g, beta, scale=16**-0.5, initial_state=x["h0"], cu_seqlens=x["cu"])
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    assert o.dtype == ht.dtype == torch.float32


def test_missing_fla_is_reported_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fla_kda_ops.cache_clear()
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla.ops.kda` raise ImportError
    try:
        with caplog.at_level(logging.WARNING, logger="k3run.kernels.kda.fla"):
            assert fla_kda_ops() is None
            assert fla_kda_ops() is None
        lines = [r for r in caplog.records if "fla-core is not importable" in r.getMessage()]
        assert len(lines) == 1
    finally:
        fla_kda_ops.cache_clear()


# GPU: fla vs the fp32 reference


@pytest.fixture
def fla() -> None:
    """Without fla-core the CUDA dispatch falls back to the reference, which would compare it with itself."""
    assert kda_backend("cuda") == "fla", "fla-core must be installed on the GPU machine (the gpu extra)"


@pytest.mark.gpu
@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lower_bound", GATES)
def test_fla_chunk_raw_inputs_match_reference(dtype: torch.dtype, lower_bound: float | None) -> None:
    # three sequences, none a multiple of the 64-token chunk, total T = 229
    x = _raw_inputs([0, 37, 100, 229], H=4, K=128, V=128, dtype=dtype, device="cuda")
    o, ht = _forward(x, lower_bound, decode=False)
    o_ref, ht_ref = _reference(x, lower_bound, decode=False)
    assert o.dtype == ht.dtype == torch.float32 and ht.shape == x["h0"].shape
    assert_close("o", o_ref, o, FLA_RTOL)
    assert_close("final state", ht_ref, ht, FLA_RTOL)
    # the host offsets (what the layer passes) change no bit
    o_host, ht_host = _forward(x, lower_bound, decode=False, host_offsets=True)
    assert torch.equal(o_host, o) and torch.equal(ht_host, ht)


@pytest.mark.gpu
@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lower_bound", GATES)
def test_fla_recurrent_decode_raw_inputs_match_reference(
    dtype: torch.dtype, lower_bound: float | None
) -> None:
    B = 5
    x = _raw_inputs(list(range(B + 1)), H=4, K=128, V=128, dtype=dtype, device="cuda")
    o, ht = _forward(x, lower_bound, decode=True)
    o_ref, ht_ref = _reference(x, lower_bound, decode=True)
    assert_close("o", o_ref, o, FLA_RTOL)
    assert_close("final state", ht_ref, ht, FLA_RTOL)


@pytest.mark.gpu
@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("lower_bound", GATES)
def test_fla_recurrent_continues_chunk_prefill(lower_bound: float | None) -> None:
    """Prefill 70 and 45 tokens with chunk_kda, then decode 3 steps with fused_recurrent_kda from its
    states: the result matches the reference run over the whole sequences."""
    lens, steps = [70, 45], 3
    full = [n + steps for n in lens]
    cu_full = [0, full[0], full[0] + full[1]]
    x = _raw_inputs(cu_full, H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    o_ref, ht_ref = _reference(x, lower_bound, decode=False)

    def rows(t: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([t[s:e] for s, e in spans])

    def part(spans: list[tuple[int, int]], cu: list[int], h0: torch.Tensor) -> dict[str, torch.Tensor]:
        p = {n: rows(x[n], spans) for n in ("q", "k", "v", "f", "b")}
        p.update(A_log=x["A_log"], dt_bias=x["dt_bias"], h0=h0, cu=torch.tensor(cu, device="cuda"))
        return p

    pre = part([(0, lens[0]), (full[0], full[0] + lens[1])], [0, lens[0], sum(lens)], x["h0"])
    o_pre, h = _forward(pre, lower_bound, decode=False)
    outs = [o_pre]
    for i in range(steps):
        tok = part(
            [(lens[0] + i, lens[0] + i + 1), (full[0] + lens[1] + i, full[0] + lens[1] + i + 1)], [0, 1, 2], h
        )
        o_t, h = _forward(tok, lower_bound, decode=True)
        outs.append(o_t)
    o_ref_pre = rows(o_ref, [(0, lens[0]), (full[0], full[0] + lens[1])])
    assert_close("prefill o", o_ref_pre, o_pre, FLA_RTOL)
    for i in range(steps):
        want = rows(
            o_ref, [(lens[0] + i, lens[0] + i + 1), (full[0] + lens[1] + i, full[0] + lens[1] + i + 1)]
        )
        assert_close(f"decode step {i} o", want, outs[1 + i], FLA_RTOL)
    assert_close("final state", ht_ref, h, FLA_RTOL)


@pytest.mark.gpu
@pytest.mark.usefixtures("fla")
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "recurrent"])
def test_fla_activated_inputs_match_reference(decode: bool) -> None:
    """chunk_kda / recurrent_kda (g, beta, q/k already activated) on CUDA go to fla without in-kernel
    options; q, k are rounded to bf16 for it, inside the same 5e-3 bound."""
    cu = [0, 1, 2, 3] if decode else [0, 50, 133]
    x = _raw_inputs(cu, H=3, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    q, k = l2norm(x["q"]), l2norm(x["k"])
    g = kda_gate(x["f"], x["A_log"], x["dt_bias"], -5.0)
    beta = torch.sigmoid(x["b"].float())
    kda = recurrent_kda if decode else chunk_kda
    o, ht = kda(q, k, x["v"], g, beta, scale=128**-0.5, initial_state=x["h0"], cu_seqlens=x["cu"])
    o_ref, ht_ref = _reference(x, -5.0, decode)
    assert_close("o", o_ref, o, FLA_RTOL)
    assert_close("final state", ht_ref, ht, FLA_RTOL)


@pytest.mark.gpu
@pytest.mark.usefixtures("fla")
def test_fla_rejects_wrong_state_shape() -> None:
    x = _raw_inputs([0, 10, 30], H=2, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    x["h0"] = x["h0"][:1]
    with pytest.raises(ValueError, match="initial_state must have shape"):
        _forward(x, -5.0, decode=False)
