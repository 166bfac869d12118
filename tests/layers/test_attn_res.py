from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from k3run.layers.attn_res import AttnResState, AttnResWeights, attn_res_layer, attn_res_mix
from k3run.testing import assert_close


def _fla_naive_attnres():
    """fla's reference, loaded from its file so that importing fla's Triton ops is not needed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "attnres" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("_fla_attnres_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_attnres


def _mix64(cands, w_norm, w_proj, eps):
    """Per-token, per-candidate loops in fp64: an independent spelling of the AttnRes formula."""
    t, d = cands[0].shape
    out = torch.zeros(t, d, dtype=torch.float64)
    q = w_norm.double() * w_proj.double().reshape(-1)
    for i in range(t):
        vs = [c[i].double() for c in cands]
        scores = torch.stack([(v / torch.sqrt((v * v).mean() + eps) * q).sum() for v in vs])
        p = torch.exp(scores - scores.max())
        p = p / p.sum()
        for pn, v in zip(p, vs, strict=True):
            out[i] += pn * v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_matches_fla_naive(dtype):
    naive = _fla_naive_attnres()
    d, eps = 48, 1e-5
    cands = [(torch.randn(6, d) * s).to(dtype) for s in (1.0, 3.0, 0.5, 2.0)]
    w_norm = 1 + 0.3 * torch.randn(d)
    w_proj = 0.5 * torch.randn(1, d)
    out = attn_res_mix(cands, w_norm, w_proj, eps)
    # fla: key RMSNorm with weight w_norm, query = w_proj (same math, other multiplication order)
    ref = naive(w_proj.reshape(d), cands, w_norm, rms_eps=eps)
    assert out.dtype == dtype
    # both fp32 internally: fp32 rounding differences only (~1e-7); bf16 output: at most one bf16 rounding
    # apart where fp32 values straddle a rounding boundary (2^-8 relative)
    assert_close("attn_res vs fla naive", ref.float(), out, rtol=1e-6 if dtype == torch.float32 else 2**-8)
    assert_close(
        "attn_res vs fp64 loops",
        _mix64(cands, w_norm, w_proj, eps),
        out,
        rtol=1e-6 if dtype == torch.float32 else 2**-8,
    )


def test_mix_rejects_bad_weights():
    with pytest.raises(ValueError, match="16 elements"):
        attn_res_mix([torch.randn(2, 16)], torch.ones(8), torch.ones(1, 16), 1e-5)


def test_block_bookkeeping_vs_index_reference():
    """5 layers, block size 2: blocks close at layers 0, 2, 4 -> the output mix sees 3 closed blocks + prefix.

    The reference recomputes every candidate list from the full history of sub-layer outputs by index
    arithmetic (block j >= 1 = sum of both sub-layer outputs of layers (j-1)S .. jS-1), in fp64.
    """
    torch.manual_seed(1)
    t, d, s, n_layers, eps = 3, 16, 2, 5, 1e-5
    emb = torch.randn(t, d, dtype=torch.float64)
    mixers = [torch.randn(d, d, dtype=torch.float64) / d**0.5 for _ in range(n_layers)]
    mlps = [torch.randn(d, d, dtype=torch.float64) / d**0.5 for _ in range(n_layers)]
    sites = []
    for _ in range(2 * n_layers + 1):
        w = AttnResWeights(d, eps, torch.float64)
        w.norm_weight.data = 1 + 0.2 * torch.randn(d, dtype=torch.float64)
        w.proj_weight.data = torch.randn(1, d, dtype=torch.float64)
        sites.append(w)

    state = AttnResState(prefix=emb)
    for i in range(n_layers):
        attn_res_layer(
            state,
            i,
            s,
            lambda x, i=i: torch.tanh(x @ mixers[i]),
            lambda x, i=i: torch.tanh(x @ mlps[i]),
            sites[2 * i],
            sites[2 * i + 1],
        )
    assert len(state.blocks) == 3
    out = sites[-1](state.candidates())

    def cands(outputs: list[torch.Tensor], n_closed: int, n_sub: int) -> list[torch.Tensor]:
        """Closed blocks (emb, then one per S layers) and the open prefix after n_sub sub-layer outputs."""
        blocks = [emb] + [sum(outputs[2 * (j - 1) * s : 2 * j * s]) for j in range(1, n_closed)]
        return blocks + [sum(outputs[2 * (n_closed - 1) * s : n_sub])]

    outputs: list[torch.Tensor] = []
    for i in range(n_layers):
        # before layer i closes its block, ceil(i/S) blocks are closed; after, i//S + 1
        a_in = emb if i == 0 else _mix_site(sites[2 * i], cands(outputs, -(-i // s), 2 * i))
        outputs.append(torch.tanh(a_in @ mixers[i]))
        m_in = _mix_site(sites[2 * i + 1], cands(outputs, i // s + 1, 2 * i + 1))
        outputs.append(torch.tanh(m_in @ mlps[i]))
    final = cands(outputs, (n_layers - 1) // s + 1, 2 * n_layers)
    assert len(final) == 4
    ref = _mix_site(sites[-1], final)
    # the implementation mixes in fp32 (as K3 does), the reference in fp64: fp32 roundings over 11 mixes;
    # a bookkeeping slip (wrong block, prefix or closing layer) changes the result by O(1)
    assert_close("attn_res model output", ref, out, rtol=1e-6)


def _mix_site(site: AttnResWeights, cands: list[torch.Tensor]) -> torch.Tensor:
    return _mix64(cands, site.norm_weight, site.proj_weight, site.eps)
