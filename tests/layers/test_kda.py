"""KimiDeltaAttention vs a reference written from kimi-architecture.md §2 on fla's naive recurrence."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from k3run.distributed import NO_TP, TPInfo
from k3run.forward_context import ForwardContext
from k3run.layers.kda import KimiDeltaAttention
from k3run.testing import RTOL, assert_close
from tests.gloo import spawn_gloo
from tests.step_schedule import ctx_for, feed_in_steps

D, H, K, W = 37, 4, 12, 4
P = H * K
EPS = 1e-5
# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32: projections, a 4-tap conv and ~100 recurrence steps each add a few 2^-24 roundings; 1e-5 relative
# leaves a wide margin (measured ~1e-7) while any wrong formula is off by O(1)
VARIANTS = {"k3": (True, -5.0), "kimi_linear": (False, None)}  # (use_full_rank_gate, gate_lower_bound)


def _load_fla_naive() -> ModuleType:
    spec = importlib.util.find_spec("fla")
    assert spec is not None and spec.submodule_search_locations, (
        "fla-core (a dev dependency) is not installed"
    )
    path = Path(spec.submodule_search_locations[0]) / "ops/kda/naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


FLA_NAIVE = _load_fla_naive()


def make_weights(full_rank: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights, scaled so every projection output is O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    w = {
        "q_proj": rnd(P, D, scale=D**-0.5),
        "k_proj": rnd(P, D, scale=D**-0.5),
        "v_proj": rnd(P, D, scale=D**-0.5),
        "f_a_proj": rnd(K, D, scale=D**-0.5),
        "f_b_proj": rnd(P, K, scale=K**-0.5),
        "b_proj": rnd(H, D, scale=D**-0.5),
        "q_conv1d": rnd(P, 1, W, scale=0.7),
        "k_conv1d": rnd(P, 1, W, scale=0.7),
        "v_conv1d": rnd(P, 1, W, scale=0.7),
        "A_log": rnd(H, scale=0.5),
        "dt_bias": rnd(P),
        "o_norm": 1 + rnd(K, scale=0.3),
        "o_proj": rnd(D, P, scale=P**-0.5),
    }
    if full_rank:
        w["g_proj"] = rnd(P, D, scale=D**-0.5)
    else:
        w["g_a_proj"] = rnd(K, D, scale=D**-0.5)
        w["g_b_proj"] = rnd(P, K, scale=K**-0.5)
    return w


def load_layer(layer: KimiDeltaAttention, w: dict[str, torch.Tensor], fused_conv: bool = False) -> None:
    def put(param: torch.nn.Parameter, t: torch.Tensor, shard_id: object = None) -> None:
        param.weight_loader(param, t, shard_id)  # type: ignore[attr-defined]

    for name, sid in layer.in_proj_shard_ids.items():
        put(layer.in_proj.weight, w[name], sid)
    put(layer.f_b_proj.weight, w["f_b_proj"])
    if not layer.use_full_rank_gate:
        put(layer.g_a_proj.weight, w["g_a_proj"])
        put(layer.g_b_proj.weight, w["g_b_proj"])
    if fused_conv:  # HF naming: one conv1d.weight [3P, 1, W]
        put(layer.conv_weight, torch.cat([w["q_conv1d"], w["k_conv1d"], w["v_conv1d"]]))
    else:
        for sid, name in enumerate(("q_conv1d", "k_conv1d", "v_conv1d")):
            put(layer.conv_weight, w[name], sid)
    put(layer.A_log, w["A_log"].reshape(1, 1, H, 1) if fused_conv else w["A_log"])  # legacy shape too
    put(layer.dt_bias, w["dt_bias"])
    put(layer.o_norm.weight, w["o_norm"])
    put(layer.o_proj.weight, w["o_proj"])
    assert layer.unfilled_parameters() == []
    for lin in (layer.in_proj, layer.f_b_proj, layer.o_proj):
        assert lin.unfilled_parameters() == []


def make_layer(
    variant: str, w: dict[str, torch.Tensor], tp: TPInfo = NO_TP, dtype: torch.dtype = torch.float32
) -> KimiDeltaAttention:
    full_rank, lb = VARIANTS[variant]
    layer = KimiDeltaAttention(
        D, H, K, conv_kernel_size=W, use_full_rank_gate=full_rank, gate_lower_bound=lb, rms_norm_eps=EPS,
        prefix="model.layers.0.self_attn", tp=tp, params_dtype=dtype,
    )  # fmt: skip
    load_layer(layer, w)
    return layer


def reference(variant: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One whole sequence x [T, D] -> [T, D], written from the spec with fla's naive recurrence (fp32)."""
    full_rank, lb = VARIANTS[variant]
    x = x.float()
    T = x.shape[0]

    def conv_silu(y: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:  # [T, P] causal depthwise
        return F.silu(F.conv1d(y.t()[None], wt, padding=W - 1, groups=P)[0, :, :T].t())

    def l2(t: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    q = l2(conv_silu(x @ w["q_proj"].T, w["q_conv1d"]).reshape(T, H, K))
    k = l2(conv_silu(x @ w["k_proj"].T, w["k_conv1d"]).reshape(T, H, K))
    v = conv_silu(x @ w["v_proj"].T, w["v_conv1d"]).reshape(T, H, K)
    z = ((x @ w["f_a_proj"].T) @ w["f_b_proj"].T).reshape(T, H, K) + w["dt_bias"].reshape(H, K)
    a = w["A_log"].exp().reshape(H, 1)
    g = -a * F.softplus(z) if lb is None else lb * torch.sigmoid(a * z)
    beta = torch.sigmoid(x @ w["b_proj"].T)
    o, _ = FLA_NAIVE.naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None], scale=K**-0.5)
    o = o[0]
    gate = x @ w["g_proj"].T if full_rank else (x @ w["g_a_proj"].T) @ w["g_b_proj"].T
    o = (
        o
        * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)
        * w["o_norm"]
        * torch.sigmoid(gate.reshape(T, H, K))
    )
    return o.reshape(T, P) @ w["o_proj"].T


def run_schedule(
    layer: KimiDeltaAttention, xs: list[torch.Tensor], steps: list[list[int]], slots: list[int]
) -> list[torch.Tensor]:
    """`feed_in_steps` over a 4-slot cache that starts out holding noise."""
    cache = layer.init_cache(4, xs[0].dtype, "cpu")
    cache.recurrent.normal_()  # stale state of a previous owner must be ignored by fresh sequences
    cache.conv.normal_()
    return feed_in_steps(layer, cache, xs, steps, slots)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_matches_reference(variant: str, poison_empty: None) -> None:
    w = make_weights(VARIANTS[variant][0])
    layer = make_layer(variant, w)
    xs = [torch.randn(70, D), torch.randn(9, D)]  # one chunk + a partial chunk, and a short sequence
    y = layer(torch.cat(xs), ctx_for([70, 9], [0, 0], None), None)
    assert_close("seq 0", reference(variant, w, xs[0]), y[:70], rtol=RTOL[torch.float32])
    assert_close("seq 1", reference(variant, w, xs[1]), y[70:], rtol=RTOL[torch.float32])
    assert y.abs().mean() > 1e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_full_sequence(variant: str) -> None:
    w = make_weights(VARIANTS[variant][0])
    layer = make_layer(variant, w)
    xs = [torch.randn(31, D), torch.randn(12, D), torch.randn(2, D)]
    # seq 0: prefill 20, continue 7 (chunked prefill from state), then decode 4 tokens one by one;
    # seq 1 joins later with a 9-token prefill; seq 2 is two tokens of prefill then one decode step
    steps = [[20, 0, 1], [7, 9, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]]
    outs = run_schedule(layer, xs, steps, slots=[2, 0, 3])
    for b, x in enumerate(xs):
        assert_close(f"seq {b}", reference(variant, w, x), outs[b], rtol=RTOL[torch.float32])


def test_fused_conv_and_legacy_A_log_load_the_same() -> None:
    w = make_weights(True)
    a = make_layer("k3", w)
    b = KimiDeltaAttention(
        D, H, K, use_full_rank_gate=True, gate_lower_bound=-5.0, params_dtype=torch.float32
    )
    load_layer(b, w, fused_conv=True)
    assert torch.equal(a.conv_weight, b.conv_weight) and torch.equal(a.A_log, b.A_log)
    assert a.conv_weight.shape == (3 * P, W)


def test_A_log_padded_to_head_dim_as_k3_stores_it() -> None:
    """moonshotai/Kimi-K3 stores A_log F32 [head_dim]: the H per-head values, then zeros."""
    w = make_weights(True)
    a = make_layer("k3", w)
    b = KimiDeltaAttention(
        D, H, K, use_full_rank_gate=True, gate_lower_bound=-5.0, prefix="L", params_dtype=torch.float32
    )
    padded = torch.cat([w["A_log"], torch.zeros(K - H)])
    load_layer(b, w | {"A_log": padded})
    assert torch.equal(a.A_log, b.A_log)
    c = KimiDeltaAttention(
        D, H, K, use_full_rank_gate=True, gate_lower_bound=-5.0, prefix="L", params_dtype=torch.float32
    )
    padded[H + 3] = 0.25
    with pytest.raises(
        ValueError,
        match=r"L.A_log: shape \(12,\) holds 4 per-head values and must be zero "
        r"after them, found 1 nonzero \(first at index 7: 0.25\)",
    ):
        c.A_log.weight_loader(c.A_log, padded)
    with pytest.raises(ValueError, match=r"L.A_log: expected shape \(4,\) or \(1, 1, 4, 1\) or \(12,\)"):
        c.A_log.weight_loader(c.A_log, torch.zeros(8))


def test_loader_errors_name_the_tensor() -> None:
    layer = KimiDeltaAttention(
        D, H, K, use_full_rank_gate=True, gate_lower_bound=-5.0, prefix="L", params_dtype=torch.float32
    )
    with pytest.raises(
        ValueError, match=r"L.A_log: expected shape \(4,\) or \(1, 1, 4, 1\) or \(12,\).*, got \(1, 4\)"
    ):
        layer.A_log.weight_loader(layer.A_log, torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"L.dt_bias: expected shape \(48,\)"):
        layer.dt_bias.weight_loader(layer.dt_bias, torch.zeros(12))
    with pytest.raises(ValueError, match=r"L.conv_weight \(shard 1\): expected shape \(48, 1, 4\)"):
        layer.conv_weight.weight_loader(layer.conv_weight, torch.zeros(48, 1, 3), 1)
    layer.dt_bias.weight_loader(layer.dt_bias, torch.zeros(48))
    with pytest.raises(ValueError, match="L.dt_bias: loaded twice"):
        layer.dt_bias.weight_loader(layer.dt_bias, torch.zeros(48))
    assert layer.unfilled_parameters() == ["A_log", "q_conv1d", "k_conv1d", "v_conv1d"]
    with pytest.raises(ValueError, match="context_lens \\[3\\] need a KDA cache"):
        layer(torch.randn(2, D), ctx_for([2], [3], None), None)


def test_bf16_close_to_fp32_reference() -> None:
    w = make_weights(True)
    layer = make_layer("k3", w, dtype=torch.bfloat16)
    xs = [torch.randn(25, D), torch.randn(6, D)]
    outs = run_schedule(layer, [x.bfloat16() for x in xs], [[20, 6], [5, 0]], slots=[1, 0])
    for b, x in enumerate(xs):
        # bf16 keeps 8 mantissa bits: each rounding is <= 2^-9 (RMS ~1.1e-3) relative. Weights, input,
        # q/k/v/f/gate projections, conv, o_norm and o_proj outputs are rounded on the way, ~10 roundings,
        # plus their spread through the recurrence: sqrt(10) * 1.1e-3 * a few ~ 1e-2; measured 6e-3..9e-3
        assert_close(f"bf16 seq {b}", reference("k3", w, x.bfloat16().float()), outs[b], rtol=2e-2)


def _tp_worker(
    tp: TPInfo, variant: str, w: dict[str, torch.Tensor], xs: list[torch.Tensor]
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = make_layer(variant, w, tp=tp)
    assert layer.in_proj.local_output_sizes[layer.in_proj_shard_ids["f_a_proj"]] == K  # replicated latent
    return run_schedule(layer, xs, [[9, 4], [1, 3], [1, 1]], slots=[0, 1])


def test_tensor_parallel_2_equals_1() -> None:
    xs = [torch.randn(11, D), torch.randn(8, D)]
    for variant in VARIANTS:
        w = make_weights(VARIANTS[variant][0], seed=3)
        single = _tp_worker(NO_TP, variant, w, xs)
        ranks = spawn_gloo(_tp_worker, 2, variant, w, xs)
        for r, outs in enumerate(ranks):
            for b in range(len(xs)):
                # the rank-local partial o_proj products are all-reduced in a different order: fp32 noise
                assert_close(f"{variant} rank {r} seq {b}", single[b], outs[b], rtol=RTOL[torch.float32])


def _decode_steps(layer: KimiDeltaAttention, device: str, steps: int = 3) -> list[torch.Tensor]:
    """A 6-token prefill of two sequences, then `steps` decode steps of both: the outputs of every step."""
    g = torch.Generator().manual_seed(11)
    cache = layer.init_cache(4, torch.float32, device)
    outs = []

    def ctx(lens: list[int], ctx_lens: list[int]) -> ForwardContext:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        return ForwardContext(
            cu_seqlens=cu.to(device), context_lens=torch.tensor(ctx_lens).to(device),
            slots=torch.tensor([1, 3]).to(device), seqlens_list=lens, context_lens_list=ctx_lens,
            slots_list=[1, 3],
        )  # fmt: skip

    outs.append(layer(torch.randn(12, D, generator=g).to(device), ctx([6, 6], [0, 0]), cache))
    for i in range(steps):
        outs.append(layer(torch.randn(2, D, generator=g).to(device), ctx([1, 1], [6 + i, 6 + i]), cache))
    return outs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forget_gate_branch_knob_gives_the_same_outputs(variant: str) -> None:
    """K3RUN_KDA_FB_SIDE: f_b_proj as a branch (inline on the CPU, queued first) gives the same bits."""
    from k3run.knobs import override_knobs

    layer = make_layer(variant, make_weights(VARIANTS[variant][0]))
    with override_knobs(kda_fb_side=False):
        want = _decode_steps(layer, "cpu")
    with override_knobs(kda_fb_side=True):
        got = _decode_steps(layer, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_forget_gate_branch_on_the_side_stream_gives_the_same_bits(variant: str) -> None:
    """On CUDA the branch runs on the side stream beside the conv and is joined before the recurrence: the
    same kernels on the same inputs, so the same bits as in the chain, prefill and decode steps."""
    from k3run.knobs import override_knobs

    layer = make_layer(variant, make_weights(VARIANTS[variant][0])).cuda()
    with override_knobs(kda_fb_side=False):
        want = _decode_steps(layer, "cuda")
    with override_knobs(kda_fb_side=True):
        got = _decode_steps(layer, "cuda")
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _fused_against_chain(variant: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """K3RUN_KDA_FUSED_DECODE: decode steps through kernels/kda/decode.py (its fp32 reference on the CPU,
    where the layer takes it only when `fused_decode_takes` is patched to say so) against the chain of conv,
    recurrence and gated norm. An fp32 layer: the two differ only in the order of fp32 sums (K-term norms
    and state products, the projections unchanged), relative RMS <= 1e-5."""
    from k3run.knobs import override_knobs
    from k3run.layers import kda as kda_layer

    layer = make_layer(variant, make_weights(VARIANTS[variant][0])).to(device)
    with override_knobs(kda_fused_decode=0):
        want = _decode_steps(layer, device)
    if device == "cpu":
        assert not kda_layer.fused_decode_takes(torch.zeros(1), 1)  # the CPU keeps the chain by default
        monkeypatch.setattr(kda_layer, "fused_decode_takes", lambda x, tokens: tokens <= 2)
    with override_knobs(kda_fused_decode=2):
        got = _decode_steps(layer, device)
    assert torch.equal(want[0], got[0])  # the prefill takes the chunked path either way
    for i, (a, b) in enumerate(zip(want[1:], got[1:], strict=True)):
        assert_close(f"decode step {i}", a, b, 1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_decode_knob_matches_the_chain(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fused_against_chain(variant, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_fused_decode_matches_the_chain(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fused_against_chain(variant, "cuda", monkeypatch)
