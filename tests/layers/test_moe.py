from __future__ import annotations

import dataclasses

import pytest
import torch

from k3run.distributed import NO_TP, TPInfo
from k3run.formats import (
    dequantize_fp8_block,
    dequantize_nvfp4,
    nvfp4_qdq,
    quantize_fp8_block,
    quantize_nvfp4,
)
from k3run.knobs import reset_knobs
from k3run.layers.activation import GatedActivation
from k3run.layers.moe import FusedExperts, route
from k3run.quant.algo import QuantAlgo
from k3run.quant.experts import compute_g1_scale_c, nvfp4_moe_scales
from k3run.testing import RTOL, assert_close, rel_rms_error

E, D, INTER, T, TOPK = 4, 32, 32, 7, 2
ACTS = {"silu": GatedActivation("silu"), "situ": GatedActivation("situ", 4.0, 25.0)}


def _route_ref(logits, bias, top_k, n_group, topk_group, renorm, scale):
    """Per-token python reference of sigmoid top-k routing with group limiting."""
    t, e = logits.shape
    ws, ids = torch.zeros(t, top_k), torch.zeros(t, top_k, dtype=torch.long)
    per = e // n_group
    for i in range(t):
        s = torch.sigmoid(logits[i].double())
        c = s + bias.double()
        gscore = [sorted(c[g * per : (g + 1) * per].tolist(), reverse=True)[:2] for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: -sum(gscore[g]))[:topk_group]
        allowed = [j for j in range(e) if j // per in keep]
        pick = sorted(allowed, key=lambda j: -c[j].item())[:top_k]
        w = s[pick]
        if renorm:
            w = w / w.sum()
        ws[i], ids[i] = (w * scale).float(), torch.tensor(pick)
    return ws, ids


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_route_matches_reference(n_group, topk_group):
    logits = torch.randn(9, 16)
    bias = 0.5 * torch.randn(16)  # large enough to change which experts win
    w, ids = route(
        logits, bias, 3, num_expert_group=n_group, topk_group=topk_group, routed_scaling_factor=2.446
    )
    w_ref, ids_ref = _route_ref(logits, bias, 3, n_group, topk_group, True, 2.446)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    # fp32 sigmoid/sum/divide vs fp64: a few fp32 roundings
    assert_close("route weights", w_ref.gather(1, order_ref.indices), w.gather(1, order.indices), rtol=1e-6)
    assert w.dtype == torch.float32
    # the weights are the UNBIASED scores: renormalised they sum to routed_scaling_factor
    assert_close("weight sum", torch.full((9,), 2.446), w.sum(-1), rtol=1e-6)
    plain_w, plain_ids = route(logits, torch.zeros(16), 3, num_expert_group=n_group, topk_group=topk_group)
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)


def test_g1_scale_c_semantics():
    g1_alphas = torch.tensor([[0.5, 0.25], [2.0, 4.0], [1.5, 3.0]])
    a2_gscale = torch.tensor(0.125)
    # SiTU: the up half is dequantized before its tanh, so only the GEMM2 input encode scale remains
    assert torch.equal(compute_g1_scale_c("situ", g1_alphas, a2_gscale), torch.full((3,), 0.125))
    assert torch.equal(compute_g1_scale_c("non_gated", g1_alphas, a2_gscale), torch.full((3,), 0.125))
    # SwiGLU: silu(g) * u is linear in u, so up's alpha (column 1) is folded into the scalar
    assert torch.equal(
        compute_g1_scale_c("silu", g1_alphas, a2_gscale), torch.tensor([0.25, 4.0, 3.0]) * 0.125
    )


def test_nvfp4_moe_scale_folding():
    s13 = torch.tensor([[0.01, 0.02], [0.03, 0.03]])
    s2 = torch.tensor([0.5, 0.25])
    in13 = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0], [0.5, 0.5]])  # global: 4 experts, 2 local
    in2 = torch.tensor([0.25, 8.0, 1.0, 2.0])
    sc = nvfp4_moe_scales(s13, s2, in13, in2, "situ", "w4a4")
    assert sc.a13.item() == 4.0 and sc.a2.item() == 8.0  # maxima over ALL experts, not the local ones
    assert torch.equal(sc.g1_alphas, s13 * 4.0)
    assert torch.equal(sc.g2_alphas, s2 * 8.0)
    assert sc.a1_gscale.item() == 0.25 and sc.a2_gscale.item() == 0.125
    assert torch.equal(sc.g1_scale_c, sc.a2_gscale.expand(2))  # upstream's SiTU contract
    sw = nvfp4_moe_scales(s13, s2, in13, in2, "silu", "w4a4")
    assert torch.equal(sw.g1_scale_c, s13[:, 1] * 4.0 / 8.0)
    w416 = nvfp4_moe_scales(s13, s2, None, None, "silu", "w4a16")
    assert w416.a13.item() == 1.0 and torch.equal(w416.g1_alphas, s13)


def _random_experts(seed: int):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, INTER, D, generator=g) * 0.2
    w3 = torch.randn(E, INTER, D, generator=g) * 3.0  # a different range: different weight_scale_2
    w2 = torch.randn(E, D, INTER, generator=g) * 0.2
    return w1, w3, w2


def _nvfp4_checkpoint(w1, w3, w2):
    """Per-expert NVFP4 tensors as ModelOpt names them; gate and up get their OWN weight_scale_2, and input
    scales differ per expert (so the max over experts is what must be used) and are not powers of two (a
    power-of-two global scale would leave the block-scaled quantization unchanged and hide a wrong one)."""
    ckpt = {}
    for e in range(w1.shape[0]):
        for which, w in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            q = quantize_nvfp4(w)
            ckpt[(e, which)] = {
                "weight": q.weight,
                "weight_scale": q.weight_scale,
                "weight_scale_2": q.weight_scale_2,
                "input_scale": torch.tensor(0.7 * 1.3**e if which != "w2" else 1.9 * 0.6**e),
            }
    return ckpt


def _load_nvfp4(experts: FusedExperts, ckpt) -> None:
    for (e, which), tensors in ckpt.items():
        for kind, t in tensors.items():
            name = ("w2_" if which == "w2" else "w13_") + kind
            p = getattr(experts, name)
            p.weight_loader(p, t, (e, which))
    experts.process_after_loading()


def _reference(x, ids, weights, gate_w, up_w, down_w, act, a13, a2):
    """Dequantized fp32 weights, plain per-token loop; activations QDQ'd with the decode scales a13 / a2
    (None: W4A16, no activation quantization)."""
    out = torch.zeros(x.shape[0], D, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t : t + 1].float()
        if a13 is not None:
            xt = nvfp4_qdq(xt, a13)
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = act.on_halves(xt @ gate_w[e].t(), xt @ up_w[e].t()).float()
            if a2 is not None:
                h = nvfp4_qdq(h, a2)
            out[t] += weights[t, k].double() * (h @ down_w[e].t()).double()[0]
    return out


def _dequant(ckpt, which):
    return torch.stack(
        [
            dequantize_nvfp4(c["weight"], c["weight_scale"], c["weight_scale_2"])
            for (e, w), c in sorted(ckpt.items())
            if w == which
        ]
    )


@pytest.mark.parametrize("act_name", ["silu", "situ"])
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_nvfp4_experts_match_dequantized_reference(act_name, mode):
    act = ACTS[act_name]
    w1, w3, w2 = _random_experts(0)
    ckpt = _nvfp4_checkpoint(w1, w3, w2)
    assert not torch.equal(ckpt[(0, "w1")]["weight_scale_2"], ckpt[(0, "w3")]["weight_scale_2"])
    experts = FusedExperts(
        E, D, INTER, act, QuantAlgo.NVFP4, ep=TPInfo(), params_dtype=torch.float32, nvfp4_act_mode=mode
    )
    _load_nvfp4(experts, ckpt)
    x = torch.randn(T, D) * 2
    weights, ids = route(torch.randn(T, E), torch.zeros(E), TOPK)
    out = experts(x, ids, weights)
    a13 = torch.tensor(0.7 * 1.3 ** (E - 1)) if mode == "w4a4" else None  # max input scale over experts
    a2 = torch.tensor(1.9) if mode == "w4a4" else None
    ref = _reference(
        x, ids, weights, _dequant(ckpt, "w1"), _dequant(ckpt, "w3"), _dequant(ckpt, "w2"), act, a13, a2
    )
    # Same quantized values, only the order of fp32 roundings differs (scales folded into the accumulators):
    # fp32-level agreement.
    assert_close(f"nvfp4 moe {act_name} {mode}", ref, out, rtol=1e-5)

    if act_name == "situ" and mode == "w4a4":
        # The SwiGLU formula for SiTU (up dequant folded into the post-activation scalar) is wrong.
        s = experts.scheme.scales
        experts.scheme.scales = dataclasses.replace(s, g1_scale_c=s.g1_alphas[:, 1] * s.a2_gscale)
        assert rel_rms_error(ref, experts(x, ids, weights)) > 0.5


def test_nvfp4_expert_parallel_matches_single_rank():
    act = ACTS["situ"]
    ckpt = _nvfp4_checkpoint(*_random_experts(1))
    x = torch.randn(T, D)
    weights, ids = route(torch.randn(T, E), torch.zeros(E), TOPK)
    full = FusedExperts(
        E, D, INTER, act, QuantAlgo.NVFP4, ep=TPInfo(), params_dtype=torch.float32, nvfp4_act_mode="w4a4"
    )
    _load_nvfp4(full, ckpt)
    parts = []
    for rank in range(2):
        ex = FusedExperts(
            E,
            D,
            INTER,
            act,
            QuantAlgo.NVFP4,
            ep=TPInfo(rank, 2),
            params_dtype=torch.float32,
            nvfp4_act_mode="w4a4",
        )
        _load_nvfp4(ex, ckpt)  # every rank sees every checkpoint tensor and keeps its own experts
        assert ex.w13_weight.shape[0] == 2 and ex.w13_input_scale.shape[0] == E
        # the folded scales of the local experts are the global ones sliced to this rank
        assert torch.equal(ex.scheme.scales.g1_alphas, full.scheme.scales.g1_alphas[2 * rank : 2 * rank + 2])
        assert torch.equal(ex.scheme.scales.a13, full.scheme.scales.a13)
        parts.append(ex(x, ids, weights))
    # different fp32 summation grouping only
    assert_close("ep=2 sum vs ep=1", full(x, ids, weights), parts[0] + parts[1], rtol=1e-6)


def test_bf16_and_fp8_experts():
    w1, w3, w2 = _random_experts(2)
    x = torch.randn(T, D)
    weights, ids = route(torch.randn(T, E), torch.zeros(E), TOPK)
    act = ACTS["situ"]
    dense = FusedExperts(E, D, INTER, act, QuantAlgo.NONE, ep=TPInfo(), params_dtype=torch.float32)
    fp8 = FusedExperts(E, D, INTER, act, QuantAlgo.FP8_PB_WO, ep=TPInfo(), params_dtype=torch.float32)
    deq = {}
    for e in range(E):
        for which, w in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            pfx = "w2_" if which == "w2" else "w13_"
            dense_p = getattr(dense, pfx + "weight")
            dense_p.weight_loader(dense_p, w, (e, which))
            q, s = quantize_fp8_block(w)
            for kind, t in (("weight", q), ("weight_scale", s)):
                p = getattr(fp8, pfx + kind)
                p.weight_loader(p, t, (e, which))
            deq[(e, which)] = dequantize_fp8_block(q, s)
    stack = lambda which, src: torch.stack([src[(e, which)] for e in range(E)])  # noqa: E731
    ref_dense = _reference(x, ids, weights, w1, w3, w2, act, None, None)
    ref_fp8 = _reference(
        x, ids, weights, stack("w1", deq), stack("w3", deq), stack("w2", deq), act, None, None
    )
    assert_close("bf16-path experts (fp32 params)", ref_dense, dense(x, ids, weights), rtol=1e-5)
    assert_close("fp8_pb_wo experts", ref_fp8, fp8(x, ids, weights), rtol=1e-5)
    assert rel_rms_error(ref_dense, ref_fp8) > 1e-3  # the fp8 reference really is the quantized one


def test_expert_loader_errors():
    ex = FusedExperts(E, D, INTER, ACTS["silu"], QuantAlgo.NVFP4, ep=TPInfo(), params_dtype=torch.bfloat16)
    q = quantize_nvfp4(torch.randn(INTER, D))
    with pytest.raises(ValueError, match=r"experts\.1\.w1 -> w13_weight: expected shape"):
        ex.w13_weight.weight_loader(ex.w13_weight, q.weight[:, :4], (1, "w1"))
    with pytest.raises(ValueError, match="expected dtype torch.uint8"):
        ex.w13_weight.weight_loader(ex.w13_weight, q.weight.float(), (1, "w1"))
    with pytest.raises(ValueError, match="does not belong"):
        ex.w13_weight.weight_loader(ex.w13_weight, q.weight, (1, "w2"))
    with pytest.raises(ValueError, match="out of range"):
        ex.w13_weight.weight_loader(ex.w13_weight, q.weight, (9, "w1"))
    with pytest.raises(ValueError, match="NVFP4 experts need"):
        FusedExperts(E, 24, INTER, ACTS["silu"], QuantAlgo.NVFP4, ep=TPInfo(), params_dtype=torch.bfloat16)


def test_w4a16_nvfp4_experts_need_no_input_scale():
    ckpt = _nvfp4_checkpoint(*_random_experts(3))
    ex = FusedExperts(
        E, D, INTER, ACTS["silu"], QuantAlgo.W4A16_NVFP4, ep=TPInfo(), params_dtype=torch.float32
    )
    assert not hasattr(ex, "w13_input_scale") and ex.scheme.act_mode == "w4a16"
    for key in ckpt:
        ckpt[key].pop("input_scale")
    _load_nvfp4(ex, ckpt)
    assert ex.unfilled_parameters() == []
    assert ex.scheme.scales.a13.item() == 1.0 and ex.scheme.scales.a2.item() == 1.0
    x = torch.randn(T, D)
    weights, ids = route(torch.randn(T, E), torch.zeros(E), TOPK)
    ref = _reference(
        x,
        ids,
        weights,
        _dequant(ckpt, "w1"),
        _dequant(ckpt, "w3"),
        _dequant(ckpt, "w2"),
        ACTS["silu"],
        None,
        None,
    )
    assert_close("w4a16 experts", ref, ex(x, ids, weights), rtol=1e-5)


def test_k3_latent_moe_block_matches_formula():
    """Router on the full x, experts on the down-projected latent, fp32 weighted sum, latent RMSNorm,
    up-projection, plus shared experts on the ORIGINAL x (kimi-architecture.md §4), all in fp64 here."""
    from k3run.layers.linear import ReplicatedLinear
    from k3run.layers.mlp import GatedMLP
    from k3run.layers.moe import KimiMoE, RouterConfig
    from k3run.layers.norm import RMSNorm

    d, lat, inter, n_sh, eps, scale = 48, 32, 16, 2, 1e-5, 1.5
    act = ACTS["situ"]
    f32 = {"params_dtype": torch.float32}
    moe = KimiMoE(
        num_experts=E,
        hidden_size=d,
        moe_intermediate_size=inter,
        num_shared_experts=n_sh,
        activation=act,
        router=RouterConfig(TOPK, routed_scaling_factor=scale),
        experts_algo=QuantAlgo.NONE,
        tp=TPInfo(),
        latent_size=lat,
        latent_norm=RMSNorm(lat, eps, torch.float32),
        latent_down=ReplicatedLinear(d, lat, prefix="down", **f32),
        latent_up=ReplicatedLinear(lat, d, prefix="up", **f32),
        shared_experts=GatedMLP(d, inter * n_sh, act, prefix="shared", **f32),
        **f32,
    )
    g = torch.Generator().manual_seed(5)
    w = {
        "gate.weight": torch.randn(E, d, generator=g) / d**0.5,
        "gate.e_score_correction_bias": 0.3 * torch.randn(E, generator=g),
        "routed_expert_down_proj.weight": torch.randn(lat, d, generator=g) / d**0.5,
        "routed_expert_up_proj.weight": torch.randn(d, lat, generator=g) / lat**0.5,
        "routed_expert_norm.weight": 1 + 0.2 * torch.randn(lat, generator=g),
        "shared_experts.down_proj.weight": torch.randn(d, inter * n_sh, generator=g) / inter**0.5,
    }
    sh_gate, sh_up = (torch.randn(inter * n_sh, d, generator=g) / d**0.5 for _ in range(2))
    w1, w3 = (torch.randn(E, inter, lat, generator=g) / lat**0.5 for _ in range(2))
    w2 = torch.randn(E, lat, inter, generator=g) / inter**0.5
    params = dict(moe.named_parameters())
    for name, t in w.items():
        params[name].weight_loader(params[name], t)
    p = params["shared_experts.gate_up_proj.weight"]
    p.weight_loader(p, sh_gate, 0)
    p.weight_loader(p, sh_up, 1)
    for e in range(E):
        for which, t in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            p = params[f"experts.{'w2' if which == 'w2' else 'w13'}_weight"]
            p.weight_loader(p, t, (e, which))
    for m in moe.modules():
        if m is not moe and hasattr(m, "process_after_loading"):
            m.process_after_loading()

    x = torch.randn(T, d, generator=g)
    x64 = x.double()

    def situ64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)

    s = torch.sigmoid(x64 @ w["gate.weight"].double().t())
    ref = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        top = (s[t] + w["gate.e_score_correction_bias"].double()).topk(TOPK).indices
        wt = s[t, top] / s[t, top].sum() * scale
        z = x64[t] @ w["routed_expert_down_proj.weight"].double().t()
        y = sum(
            wk * (situ64(w1[e].double() @ z, w3[e].double() @ z) @ w2[e].double().t())
            for wk, e in zip(wt, top.tolist(), strict=True)
        )
        y = y / torch.sqrt((y * y).mean() + eps) * w["routed_expert_norm.weight"].double()
        ref[t] = y @ w["routed_expert_up_proj.weight"].double().t()
    ref += (
        situ64(x64 @ sh_gate.double().t(), x64 @ sh_up.double().t())
        @ w["shared_experts.down_proj.weight"].double().t()
    )
    # fp32 model vs fp64 formula: fp32 roundings only
    assert_close("K3 latent MoE block", ref, moe(x), rtol=1e-5)


def _kernel_case(
    act_name: str, device: str, kernels: bool | None, dtype=torch.float32, seed: int = 3, d: int = 128,
    i: int = 128, tokens: int = 9, ep: TPInfo = NO_TP,
):  # fmt: skip
    """NVFP4 experts with D = I = 128 (the kernel path's multiple of 128) loaded from a ModelOpt-style
    checkpoint, and a batch routed over them (over all 4 experts; with `ep` this rank holds its share)."""
    e = 4
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (
        torch.randn(e, *shape, generator=g) * s for shape, s in (((i, d), 0.2), ((i, d), 3.0), ((d, i), 0.2))
    )
    # the W4A16 checkpoint form: no input scales
    ckpt = {
        key: {kind: t for kind, t in tensors.items() if kind != "input_scale"}
        for key, tensors in _nvfp4_checkpoint(w1, w3, w2).items()
    }
    with torch.device(device):
        ex = FusedExperts(e, d, i, ACTS[act_name], QuantAlgo.W4A16_NVFP4, ep=ep, params_dtype=torch.float32)
    ex.scheme.kernels = kernels
    _load_nvfp4(ex, ckpt)
    x = (torch.randn(tokens, d, generator=g) * 2).to(device=device, dtype=dtype)
    weights, ids = route(torch.randn(tokens, e, generator=g).to(device), torch.zeros(e, device=device), 2)
    return ex, x, ids, weights


def test_kernel_case_splits_over_expert_parallel_ranks() -> None:
    """The kernel case's EP form (the GPU grouped test's miss case): each rank holds its 2 of the 4 experts,
    and the two ranks' sums add up to the whole (fp32 grouping only)."""
    full, x, ids, weights = _kernel_case("silu", "cpu", kernels=False)
    parts = []
    for rank in range(2):
        ex, *_ = _kernel_case("silu", "cpu", kernels=False, ep=TPInfo(rank, 2))
        assert ex.num_local == 2 and ex.first == 2 * rank
        parts.append(ex(x, ids, weights))
    assert_close("kernel case, ep 2 vs 1", full(x, ids, weights), parts[0] + parts[1], rtol=1e-6)


def test_large_cpu_experts_take_the_fused_cpu_gemv() -> None:
    """On the CPU, experts of at least CPU_FUSED_MIN_WEIGHTS weights default to the kernel path, whose
    nvfp4_linear runs the fused compiled GEMV (kernels/nvfp4_gemm/cpu.py); it agrees with the reference
    experts up to fp32 summation order (relative 1e-5 at K = 1024); small experts keep the reference."""
    ex_k, x, ids, weights = _kernel_case("situ", "cpu", kernels=None, d=1024, i=1024, tokens=3)
    ex_ref, *_ = _kernel_case("situ", "cpu", kernels=False, d=1024, i=1024, tokens=3)
    assert ex_k.scheme.kernels and not ex_ref.scheme.kernels
    assert_close("cpu fused experts", ex_ref(x, ids, weights), ex_k(x, ids, weights), rtol=1e-5)
    small, *_ = _kernel_case("situ", "cpu", kernels=None)
    assert not small.scheme.kernels


@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_nvfp4_expert_kernel_path_folds_the_scales_exactly(act_name):
    """The kernel path (global scales and alphas folded into per-row decode scales, run here through the
    kernels' fp32 CPU reference) equals the dequantized reference path up to fp32 rounding order."""
    ex_ref, x, ids, weights = _kernel_case(act_name, "cpu", kernels=False)
    ex_k, *_ = _kernel_case(act_name, "cpu", kernels=True)
    assert ex_k.scheme.kernels and not ex_ref.scheme.kernels
    assert_close(f"expert kernel path {act_name}", ex_ref(x, ids, weights), ex_k(x, ids, weights), rtol=1e-5)
    # the other activation's folding is caught: SwiGLU's (up rows scaled by g1_scale_c = a2_gscale here, the
    # up alpha lost) on SiTU, SiTU's (g1_scale_c = g1_alphas_up also on GEMM2: counted twice) on SiLU
    gs13, gs2 = ex_k.scheme.kernel_scales
    s = ex_k.scheme.scales
    if act_name == "situ":
        ex_k.scheme.kernel_scales = (
            torch.cat([gs13[:, :128], s.g1_scale_c[:, None].expand(-1, 128)], 1),
            gs2,
        )
    else:
        ex_k.scheme.kernel_scales = (gs13, gs2 * s.g1_scale_c[:, None])
    assert rel_rms_error(ex_ref(x, ids, weights), ex_k(x, ids, weights)) > 1e-2


def test_nvfp4_expert_kernel_path_needs_w4a16_and_multiples_of_128():
    with pytest.raises(ValueError, match="multiples of 128, got w4a16, D=32, I=32"):
        ex = FusedExperts(
            E, D, INTER, ACTS["silu"], QuantAlgo.W4A16_NVFP4, ep=TPInfo(), params_dtype=torch.float32
        )
        ex.scheme.kernels = True
        _load_nvfp4(
            ex,
            {
                k: {n: t for n, t in v.items() if n != "input_scale"}
                for k, v in _nvfp4_checkpoint(*_random_experts(0)).items()
            },
        )
    ex, *_ = _kernel_case("silu", "cpu", kernels=None)
    assert ex.scheme.kernels is False  # CPU keeps the exact fp32 reference by default


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_nvfp4_experts_use_the_kernels(act_name):
    """On CUDA the experts repack in place to the kernel layout and run the W4A16 kernels: bf16 activations,
    gate/up and h rounded to bf16 (<= 2^-9 each) against the fp32 reference path: bound 2^-7."""
    ex_ref, x, ids, weights = _kernel_case(act_name, "cpu", kernels=False, dtype=torch.bfloat16)
    ex, *_ = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16)
    from k3run.kernels.nvfp4_gemm import default_cuda_layout

    assert (
        ex.scheme.kernels
        and ex.scheme.split128
        and ex.scheme.tiled == (default_cuda_layout(x.new_empty(0, device="cuda").device) == "tiled128")
    )
    for k in range(4):  # the in-place repack (split128, then tiled128 on sm_89+) is lossless
        for a, b in zip(ex.scheme.expert_tensors(ex, k), ex_ref.scheme.expert_tensors(ex_ref, k)):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
    out = ex(x.cuda(), ids.cuda(), weights.cuda())
    assert_close(f"gpu experts {act_name}", ex_ref(x.float(), ids, weights), out, rtol=2.0**-7)


def _bf16_ep_case(seed: int):
    """Unquantized experts on EP rank 1 of 2 (local experts 4..7 of 8), fp32, and T tokens routed top-3 over
    all 8 (so some picks are other ranks' experts)."""
    ex = FusedExperts(
        8, D, INTER, ACTS["situ"], QuantAlgo.NONE, ep=TPInfo(rank=1, size=2), params_dtype=torch.float32
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.w13_weight.copy_(torch.randn(ex.w13_weight.shape, generator=g) * 0.2)
        ex.w2_weight.copy_(torch.randn(ex.w2_weight.shape, generator=g) * 0.2)
    x = torch.randn(T, D, generator=g)
    weights, ids = route(torch.randn(T, 8, generator=g), torch.zeros(8), 3)
    return ex, x, weights, ids


def test_fused_experts_dispatch_is_the_plain_per_expert_loop():
    """The sort-based dispatch (one host sync) gives bit for bit what a loop over experts with nonzero() does,
    including picks that land on other EP ranks' experts."""
    from k3run.layers.moe import fused_experts

    ex, x, weights, ids = _bf16_ep_case(seed=5)
    ids[0, 0], ids[1, 2] = 4, 4  # a repeated expert
    want = torch.zeros(T, D)
    local = ids - ex.first
    for e in range(ex.num_local):
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel():
            want.index_add_(0, tok, ex.expert(e, x[tok]).float() * weights[tok, slot].float().unsqueeze(-1))
    got = fused_experts(ex, x, ids, weights)
    assert torch.equal(got, want)
    assert (local < 0).any() and ((local >= 0) & (local < ex.num_local)).any()  # both kinds of picks present


def test_dense_experts_match_the_per_expert_loop():
    """The host-sync-free dense path (what a CUDA graph captures when the grouped launches do not apply):
    every local expert over every token, times its routing weight or 0, in expert order. fp32: equal to
    the loop up to the order in which one token's two slots on the same expert are added (~1e-7)."""
    from k3run.layers.moe import DENSE_MAX_EXPERTS, fused_experts

    ex, x, weights, ids = _bf16_ep_case(seed=6)
    ids[0, :2] = 5  # one token's two slots on one expert
    loop = fused_experts(ex, x, ids, weights)
    assert_close("dense experts", loop, fused_experts(ex, x, ids, weights, dense=True), rtol=1e-6)
    # a sync-free step (ForwardContext.sync_free) takes the dense path too
    sync_free = fused_experts(ex, x, ids, weights, sync_free=True)
    assert_close("dense experts (sync-free step)", loop, sync_free, rtol=1e-6)
    assert torch.equal(sync_free, fused_experts(ex, x, ids, weights, dense=True))
    assert not bool(fused_experts(ex, x, torch.zeros_like(ids), weights, dense=True).any())  # all remote
    big = FusedExperts(
        DENSE_MAX_EXPERTS + 1, D, INTER, ACTS["situ"], QuantAlgo.NONE, ep=NO_TP, params_dtype=torch.float32
    )
    with pytest.raises(ValueError, match="17 local experts"):
        fused_experts(big, x, ids, weights, dense=True)


@pytest.mark.parametrize("act_name", ["silu", "situ"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_picked_experts_match_the_loop(act_name, dtype):
    """The compiled CPU decode step's form (each pick runs its own expert, weights gathered by id), run here
    eagerly: unquantized experts on EP rank 1 of 2 (picks of the other rank's experts weigh 0) and NVFP4
    reference experts with their decoded stack. Bounds as for the dense path: fp32 the loop's operations in
    another summation order (1e-6); bf16 one ulp where an fp32 sum rounds the other way (2^-8)."""
    from k3run.layers.moe import _fused_experts_picked, fused_experts

    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    ex, x, weights, ids = _bf16_ep_case(seed=7)
    ids[0, :2] = 5  # one token's two slots on one expert
    x = x.to(dtype)
    assert_close(
        "picked bf16-kind experts",
        fused_experts(ex, x, ids, weights),
        _fused_experts_picked(ex, x, ids, weights),
        rtol,
    )
    assert not bool(_fused_experts_picked(ex, x, torch.zeros_like(ids), weights).any())  # all remote
    ex, x, ids, weights = _kernel_case(act_name, "cpu", kernels=False, dtype=dtype)
    loop = fused_experts(ex, x, ids, weights)
    stack, ex.scheme.ref_stack = ex.scheme.ref_stack, None  # small CPU experts decode their stack at load
    assert _fused_experts_picked(ex, x, ids, weights) is None  # without it: the dense path's job
    ex.scheme.ref_stack = stack
    assert_close(f"picked nvfp4 {act_name}", loop, _fused_experts_picked(ex, x, ids, weights), rtol)


@pytest.mark.parametrize("act_name", ["silu", "situ"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_nvfp4_reference_experts_batched_match_the_loop(act_name, dtype):
    """NVFP4 reference experts (no kernels) with their decoded weights cached (what the CUDA-graph path
    does): the dense path runs all experts as batched matmuls with the per-expert alphas broadcast. fp32:
    the loop's operations in another summation order (~1e-6); bf16: GEMM1's h and each expert's output are
    rounded to bf16 in both, one bf16 ulp apart where the fp32 sums round differently: 2^-8."""
    from k3run.layers.moe import fused_experts

    ex, x, ids, weights = _kernel_case(act_name, "cpu", kernels=False, dtype=dtype)
    loop = fused_experts(ex, x, ids, weights)
    ex.scheme.cache_reference_weights(ex)
    assert ex.scheme.ref_stack is not None and ex.scheme.ref_stack[0].shape == (4, 256, 128)
    assert_close(
        f"dense nvfp4 {act_name}", loop, fused_experts(ex, x, ids, weights, dense=True),
        rtol=1e-6 if dtype == torch.float32 else 2**-8,
    )  # fmt: skip
    assert_close(f"cached loop {act_name}", loop, fused_experts(ex, x, ids, weights), rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_grouped_experts_match_the_per_expert_loop(act_name):
    """Decode through the two grouped launches (one pick per program row, no host sync) against the
    per-expert loop on the same repacked weights: the same products, other split_k and summation orders;
    gate/up and h are rounded to bf16 in both (<= 2^-9 each, and one ulp apart where the fp32 sums round
    differently): bound 2^-7. On EP rank 0 of 2 (experts 0-1 local) the picks of experts 2-3 contribute
    nothing in both paths, one token (a program per pick) and 9 (expert-major); the EP 1 launches skip
    their outputs' zero fill (every pick is in a group), so every row they return must be written."""
    from k3run.layers.moe import fused_experts

    for ep in (NO_TP, TPInfo(0, 2)):
        ex, x, ids, weights = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16, ep=ep)
        if not ex.scheme.tiled:
            pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
        assert ex.grouped_ok(x)
        for t in (1, x.shape[0]):
            loop = fused_experts(ex, x[:t], ids[:t], weights[:t], grouped=False)
            got = fused_experts(ex, x[:t], ids[:t], weights[:t])
            assert_close(f"grouped experts {act_name} ep {ep.size} {t} tokens", loop, got, rtol=2.0**-7)
            assert bool(got.isfinite().all())
        assert float(got.abs().max()) > 0
    only_misses = torch.full_like(ids, 3)  # every pick on the other rank's experts
    assert not bool(fused_experts(ex, x, only_misses, weights).any())


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_activation_in_gemm1_matches_the_separate_launch(act_name):
    """K3RUN_MOE_ACT_IN_GEMM1 (128 against 0): GEMM1's epilogue applies the gated activation (gate row j and
    up row j + 8 of each 16-row block), against GEMM1 then moe_ops' gated kernel, at 1 token (a program per
    pick) and 9 (expert-major), every expert local and on EP rank 0 of 2. Both round gate / up to bf16 first
    and h to bf16 last; the epilogue's exp and tanh are Triton's approximations where the gated kernel uses
    libdevice (a few fp32 ulps), so h differs by at most a bf16 ulp here and there: RTOL[bf16] on the
    output."""
    from k3run.knobs import override_knobs
    from k3run.layers.moe import fused_experts

    for ep in (NO_TP, TPInfo(0, 2)):
        ex, x, ids, weights = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16, ep=ep)
        if not ex.scheme.tiled:
            pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
        for t in (1, x.shape[0]):
            with override_knobs(moe_act_in_gemm1=0):
                want = fused_experts(ex, x[:t], ids[:t], weights[:t])
            with override_knobs(moe_act_in_gemm1=128):
                got = fused_experts(ex, x[:t], ids[:t], weights[:t])
            assert_close(f"activation in GEMM1, {act_name}, ep {ep.size}, {t} tokens", want, got,
                         rtol=RTOL[torch.bfloat16])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_cuda_gemv_experts_match_the_gluon_launches(act_name, monkeypatch):
    """K3RUN_SM90_GEMV_EXPERTS=1 (the routed experts' decode launches on the CUDA GEMV: per pick at 1 token,
    expert-major at 4 and 9, the activation in GEMM1's epilogue and apart, every expert local and on EP rank 0
    of 2) against the Gluon launches: the same products summed in another order, gate / up and h rounded to
    bf16 in both, so the bound of the tests above (2^-7); the CUDA launches must have run wherever they take
    the call (token tiles of 8 and 16, the activation epilogue at 8). sm_90 only."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90
    from k3run.knobs import override_knobs
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import by_expert_tile

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or not sm90.available():
        pytest.skip("needs an sm_90 GPU and the CUDA extension")
    calls: list[str] = []
    for name in ("nvfp4_sm90_gemv_grouped", "nvfp4_sm90_gemv_by_expert"):
        real = getattr(sm90, name)
        monkeypatch.setattr(sm90, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    for ep in (NO_TP, TPInfo(0, 2)):
        ex, x, ids, weights = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16, ep=ep)
        for t in (1, 4, x.shape[0]):
            for act_in in (0, 128):
                with override_knobs(moe_act_in_gemm1=act_in, sm90_gemv_experts=False):
                    want = fused_experts(ex, x[:t], ids[:t], weights[:t])
                calls.clear()
                with override_knobs(moe_act_in_gemm1=act_in, sm90_gemv_experts=True):
                    got = fused_experts(ex, x[:t], ids[:t], weights[:t])
                bt = by_expert_tile(t, ids.shape[1], ex.num_experts) if t >= 2 else 8
                takes = bt in (8, 16) and (t > act_in or bt == 8)  # act_in >= t: the activation epilogue
                assert bool(calls) == takes, (ep.size, t, act_in, bt)
                assert_close(f"CUDA GEMV experts {act_name} ep {ep.size} {t} tokens act {act_in}", want, got,
                             rtol=2.0**-7)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_stream_experts_match_the_expert_major_launches(act_name, monkeypatch):
    """K3RUN_MOE_STREAM=R/S (the expert-major launches as stream-K) against the expert-major launches, at 2, 4
    and all tokens, with the activation in GEMM1's epilogue and apart, every expert local and on EP rank 0 of
    2: items split between two programs sum their two fp32 halves once, so one bf16 ulp apart at most where
    a sum rounds the other way (2^-7, the bound of the tests above); the stream launch must have run."""
    from k3run.kernels.nvfp4_gemm import expert_stream
    from k3run.knobs import override_knobs
    from k3run.layers.moe import fused_experts

    calls: list[int] = []
    real = expert_stream.launch_stream
    monkeypatch.setattr(expert_stream, "launch_stream", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for ep in (NO_TP, TPInfo(0, 2)):
        ex, x, ids, weights = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16, ep=ep)
        if not ex.scheme.tiled:
            pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
        for t in (2, 4, x.shape[0]):
            for act_in, form in ((0, "1/2"), (128, "3/3")):
                with override_knobs(moe_act_in_gemm1=act_in, sm90_gemv_experts=False):
                    want = fused_experts(ex, x[:t], ids[:t], weights[:t])
                calls.clear()
                with override_knobs(moe_act_in_gemm1=act_in, sm90_gemv_experts=False, moe_stream=form):
                    got = fused_experts(ex, x[:t], ids[:t], weights[:t])
                assert len(calls) == 2, (ep.size, t, act_in)
                assert_close(f"stream experts {act_name} ep {ep.size} {t} tokens {form}", want, got,
                             rtol=2.0**-7)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
@pytest.mark.parametrize("wgmma", [True, False])
def test_gpu_prefill_grouped_experts_match_the_per_expert_loop(act_name, wgmma, monkeypatch):
    """Prefill sizes (300 tokens, from TILE_FROM_TOKENS) through the grouped tensor-core GEMMs (the wgmma
    kernel on sm_90, or the Triton tile GEMM) against the per-expert loop: the bound of the decode test
    above (gate/up and h rounded to bf16 in both, one ulp apart where fp32 sums round differently: 2^-7).
    (Other ranks' picks: the kernel tests; with every expert local, ids are always in range.)"""
    import k3run.kernels.nvfp4_gemm as ng
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import TILE_FROM_TOKENS

    if not wgmma:
        monkeypatch.setattr(ng, "_WGMMA_OK", False)
    ex, x, ids, weights = _kernel_case(act_name, "cuda", kernels=None, dtype=torch.bfloat16, tokens=300)
    if not ex.scheme.tiled:
        pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
    assert ids.shape[0] >= TILE_FROM_TOKENS
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    got = fused_experts(ex, x, ids, weights)
    assert_close(f"prefill grouped {act_name} wgmma={wgmma}", loop, got, rtol=2.0**-7)
    assert ng._WGMMA_OK == wgmma  # the wgmma kernel built (no fallback) when it was on


@pytest.mark.gpu
def test_gpu_decode_batches_with_many_picks_an_expert_take_the_wgmma_gemms(monkeypatch):
    """40 decode tokens top-2 over 4 experts (20 picks an expert, over TILES_FROM_PICKS_PER_EXPERT) run the
    grouped wgmma GEMMs on sm_90 (counted), and match the per-expert loop within the prefill test's bound."""
    import k3run.kernels.nvfp4_gemm as ng
    from k3run.kernels.nvfp4_gemm import wgmma
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import BY_EXPERT_MAX_TOKENS, TILES_FROM_PICKS_PER_EXPERT

    ex, x, ids, weights = _kernel_case("situ", "cuda", kernels=None, dtype=torch.bfloat16, tokens=40)
    if not ex.scheme.tiled or not ng._wgmma_ok(x.device):
        pytest.skip("needs the wgmma kernel (sm_90) and the tiled128 layout")
    assert ids.shape[0] <= BY_EXPERT_MAX_TOKENS and ids.numel() >= TILES_FROM_PICKS_PER_EXPERT * ex.num_local
    calls = []
    real = wgmma.nvfp4_wgmma_grouped
    monkeypatch.setattr(wgmma, "nvfp4_wgmma_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    got = fused_experts(ex, x, ids, weights)
    assert len(calls) == 2  # GEMM1 and GEMM2
    assert_close("decode on the wgmma GEMMs", loop, got, rtol=2.0**-7)


def test_wgmma_block_picks_rule():
    from k3run.quant.experts import wgmma_block_picks

    assert wgmma_block_picks(0, 8) == 32
    assert wgmma_block_picks(256 * 8, 256) == 32  # Kimi Linear experts, 8 picks each
    assert wgmma_block_picks(4096 * 8, 256) == 64  # 128 picks each
    assert wgmma_block_picks(4096 * 16, 56) == 128  # K3 experts at EP16, 1170 picks each


def test_by_expert_tile_choice(monkeypatch):
    """The expert-major token tile: 8 up to 8 tokens or up to 4 expected picks an expert (over every rank's
    experts), then 16 (up to BY_EXPERT_MAX_TOKENS); the environment override takes only 8 / 16 / 32 and
    names the variable otherwise."""
    from k3run.quant import experts as moe

    # the K3-shaped slice's experts: 64, top-16 (4 picks an expert at 16 tokens)
    tiles = [moe.by_expert_tile(t, 16, 64) for t in (2, 8, 16, 17, moe.BY_EXPERT_MAX_TOKENS)]
    assert tiles == [8, 8, 8, 16, 16]
    # 8 experts, top-2 (4 picks an expert at 16 tokens): the batch rule alone up to 8 tokens
    assert [moe.by_expert_tile(t, 2, 8) for t in (8, 9, 16, 17)] == [8, 8, 8, 16]
    # Kimi Linear's: 256, top-8 (4 picks an expert at 128 tokens); K3's 384 at top-16 (96 tokens)
    assert [moe.by_expert_tile(t, 8, 256) for t in (2, 32, 128, 129)] == [8, 8, 8, 16]
    assert [moe.by_expert_tile(t, 16, 384) for t in (96, 97)] == [8, 16]
    monkeypatch.setenv("K3RUN_MOE_BY_EXPERT_TILE", "32")
    reset_knobs()
    assert moe.by_expert_tile(4, 8, 256) == 32
    monkeypatch.setenv("K3RUN_MOE_BY_EXPERT_TILE", "24")
    reset_knobs()
    with pytest.raises(ValueError, match="K3RUN_MOE_BY_EXPERT_TILE.*'24'"):
        moe.by_expert_tile(4, 8, 256)


def test_expert_split_choice(monkeypatch):
    """The grouped expert launches' split_k: 1 by default, K3RUN_MOE_EXPERT_SPLIT=N fixes it, 0 hands it to
    one_wave_split (here Kimi Linear's w2 at 8 tokens: 64 groups of 2304 rows over K = 1024 on 132 SMs)."""
    from k3run.kernels.nvfp4_gemm import one_wave_split
    from k3run.quant import experts as moe

    monkeypatch.delenv("K3RUN_MOE_EXPERT_SPLIT", raising=False)
    reset_knobs()
    assert moe.expert_split(8, 2304 * 64, 1024, 132) == (1, None)
    monkeypatch.setenv("K3RUN_MOE_EXPERT_SPLIT", "0")
    reset_knobs()
    assert moe.expert_split(8, 2304 * 64, 1024, 132) == one_wave_split(8, 2304 * 64, 1024, 132) == (4, None)
    monkeypatch.setenv("K3RUN_MOE_EXPERT_SPLIT", "2")
    reset_knobs()
    assert moe.expert_split(8, 2304 * 64, 1024, 132) == (2, None)
    reset_knobs()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile", ["16", "32"])
def test_gpu_by_expert_tiles_match_the_per_expert_loop(monkeypatch, tile):
    """40 tokens top-2 over 4 experts (~20 picks per expert: two 16-token groups or one 32-token group per
    expert) through the expert-major launches with each tile against the per-expert loop: the bound of the
    grouped test (bf16 gate/up and h, other summation orders: 2^-7)."""
    from k3run.layers.moe import fused_experts
    from k3run.quant import experts as moe

    ex, x, ids, weights = _kernel_case("situ", "cuda", kernels=None, dtype=torch.bfloat16, tokens=40)
    if not ex.scheme.tiled:
        pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    monkeypatch.setattr(moe, "TILES_FROM_PICKS_PER_EXPERT", 1 << 20)  # the expert-major launches, not wgmma
    monkeypatch.setenv("K3RUN_MOE_BY_EXPERT_TILE", tile)
    reset_knobs()
    got = fused_experts(ex, x, ids, weights)
    assert_close(f"by expert tile {tile}", loop, got, rtol=2.0**-7)
    assert float(got.abs().max()) > 0


def test_small_cpu_nvfp4_experts_decode_once():
    """NVFP4 experts on the CPU's reference path keep their decoded weights after loading (below
    CPU_REFERENCE_CACHE_BYTES) and compute the same bits as decoding at every call."""
    from k3run.quant.experts import CPU_REFERENCE_CACHE_BYTES

    act = ACTS["situ"]
    experts = FusedExperts(E, D, INTER, act, QuantAlgo.NVFP4, ep=TPInfo(), params_dtype=torch.float32)
    _load_nvfp4(experts, _nvfp4_checkpoint(*_random_experts(0)))
    assert not experts.scheme.kernels and experts.scheme.ref_stack is not None
    assert experts.scheme.reference_bytes(experts) <= CPU_REFERENCE_CACHE_BYTES
    x = torch.randn(T, D)
    weights, ids = route(torch.randn(T, E), torch.zeros(E), TOPK)
    kept = experts(x, ids, weights)
    experts.scheme.ref_stack = None  # decode at every call again
    assert torch.equal(experts(x, ids, weights), kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_experts_match_the_per_expert_loop(dtype):
    """16-bit experts as two grouped GEMMs (torch._grouped_mm; on CPU tensors torch's loop over the groups)
    over picks sorted by expert, against the per-expert loop: picks of other EP ranks' experts, a local
    expert with no picks, one token's two slots on one expert. The same operations and roundings in the same
    order per expert (GEMM1 out and h in the activation dtype), so equal up to the fp32 slot sum's order
    where a token's slots share an expert: 1e-6 (fp32) / one bf16 ulp of an expert output, 2^-8 (bf16)."""
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import grouped_mm_experts

    ex, x, weights, ids = _bf16_ep_case(seed=9)
    ex = ex.to(dtype)
    x = x.to(dtype)
    ids[0, :2] = 5
    ids[ids == 6] = 7  # local expert 6 gets no picks
    loop = fused_experts(ex, x, ids, weights)
    got = grouped_mm_experts(ex, x, ids, weights)
    assert_close(f"grouped_mm experts {dtype}", loop, got, rtol=1e-6 if dtype == torch.float32 else 2**-8)
    remote = grouped_mm_experts(ex, x, torch.zeros_like(ids), weights)  # every pick on rank 0
    assert not bool(remote.any())
    assert not ex.grouped_ok(x)  # CPU tensors: fused_experts keeps the loop there


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_grouped_mm_experts_match_the_loop_and_capture(act_name):
    """bf16 experts on an sm_90 GPU: torch._grouped_mm (CUTLASS) against the per-expert loop, and the same
    call captured in a CUDA graph and replayed (no host synchronisation). bf16 bound as above."""
    from k3run.layers.moe import experts_sync_free, fused_experts
    from k3run.quant.experts import grouped_mm_experts

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's bf16 kernel needs sm_90")
    with torch.device("cuda"):
        ex = FusedExperts(64, 256, 128, ACTS[act_name], QuantAlgo.NONE, ep=NO_TP, params_dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        ex.w13_weight.copy_(torch.randn(ex.w13_weight.shape, generator=g, device="cuda") * 0.1)
        ex.w2_weight.copy_(torch.randn(ex.w2_weight.shape, generator=g, device="cuda") * 0.1)
    x = torch.randn(300, 256, device="cuda", generator=g).bfloat16()
    weights, ids = route(torch.randn(300, 64, device="cuda", generator=g), torch.zeros(64, device="cuda"), 8)
    assert ex.grouped_ok(x) and experts_sync_free(ex, 64, 8, torch.bfloat16, x.device) is None
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    assert_close(f"gpu grouped_mm {act_name}", loop, fused_experts(ex, x, ids, weights), rtol=2**-8)
    xs, ws, ii = x[:32].clone(), weights[:32].clone(), ids[:32].clone()
    want = grouped_mm_experts(ex, xs, ii, ws)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped_mm_experts(ex, xs, ii, ws)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = grouped_mm_experts(ex, xs, ii, ws)
    graph.replay()
    assert torch.equal(out, want)
