"""KimiMoE's shared expert as one more expert of the routed experts' grouped launches (`fuse_shared`).

The fusion stacks the shared expert's NVFP4 weights after the local routed experts and appends it to every
token's picks at weight 1. The CPU tests run the fused forward through a stand-in for the grouped launches
(`_grouped_on_the_cpu`: each pick through `FusedExperts.expert`, the kernels' combine), so they check what
the fusion adds (the stacked weights and decode scales, the appended pick, its index) without a GPU; the GPU
tests run the real grouped launches, eagerly and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from k3run.distributed import TPInfo
from k3run.knobs import override_knobs
from k3run.layers.activation import GatedActivation
from k3run.layers.mlp import GatedMLP
from k3run.layers.moe import KimiMoE, RouterConfig
from k3run.quant.algo import QuantAlgo
from k3run.quant.modelopt import ModelOptConfig
from k3run.testing import RTOL, assert_close, rel_rms_error
from tests.tp_utils import checkpoint_tensors, load_shards

ACTS = {"silu": GatedActivation("silu"), "situ": GatedActivation("situ", 4.0, 25.0)}


def _moe(
    act_name: str, device: str, dtype: torch.dtype, d: int = 256, i: int = 128, e: int = 6, seed: int = 7
):
    """A Kimi-Linear-like MoE block (top-2 of e experts, one shared expert of the routed width) with W4A16
    NVFP4 routed experts and shared linears, loaded from ModelOpt-style tensors and processed. Gate and up
    get different weight_scale_2 (the shared gate_up keeps a decode scale per row)."""
    from k3run.quant.experts import NvFp4Experts

    act = ACTS[act_name]
    qcfg = ModelOptConfig(quant_algo=QuantAlgo.W4A16_NVFP4.value)
    g = torch.Generator().manual_seed(seed)
    with torch.device(device):
        shared = GatedMLP(d, i, act, qcfg=qcfg, prefix="mlp.shared_experts", params_dtype=dtype)
        moe = KimiMoE(
            num_experts=e, hidden_size=d, moe_intermediate_size=i, num_shared_experts=1, activation=act,
            router=RouterConfig(2, routed_scaling_factor=2.5), experts_algo=QuantAlgo.W4A16_NVFP4,
            tp=TPInfo(), shared_experts=shared,
            params_dtype=dtype, prefix="mlp",
        )  # fmt: skip
    assert isinstance(moe.experts.scheme, NvFp4Experts)
    for name, t in (("weight", torch.randn(e, d, generator=g) / d**0.5), ("e_score_correction_bias", None)):
        p = getattr(moe.gate, name)
        p.weight_loader(p, t if t is not None else 0.1 * torch.randn(e, generator=g))
    ex = moe.experts
    for k in range(e):
        for which, shape, s in (("w1", (i, d), 0.2), ("w3", (i, d), 3.0), ("w2", (d, i), 0.2)):
            tensors = checkpoint_tensors("nvfp4", torch.randn(*shape, generator=g) * s)
            for kind in ("weight", "weight_scale", "weight_scale_2"):
                p = getattr(ex, ("w2_" if which == "w2" else "w13_") + kind)
                p.weight_loader(p, tensors[kind], (k, which))
    mlp = moe.shared_experts
    gate, up = (checkpoint_tensors("nvfp4", torch.randn(i, d, generator=g) * s) for s in (0.2, 3.0))
    down = checkpoint_tensors("nvfp4", torch.randn(d, i, generator=g) * 0.2)
    no_input_scale = [{k: v for k, v in t.items() if k != "input_scale"} for t in (gate, up, down)]
    load_shards(mlp.gate_up_proj, no_input_scale[:2], merged=True)
    load_shards(mlp.down_proj, no_input_scale[2:], merged=False)
    return moe, g


def _process(moe: KimiMoE, force_kernels: bool = False) -> None:
    if force_kernels:  # the W4A16 kernel path on the CPU (its fp32 reference): what the GPU runs
        moe.experts.scheme.kernels = True
    for module in reversed(list(moe.modules())):
        if hasattr(module, "process_after_loading"):
            module.process_after_loading()


def _grouped_on_the_cpu(ex, x, ids, weights, finish):
    """The grouped launches' contract on the CPU: every (token, slot) pick through its stacked expert,
    each output in x's dtype, then the kernels' fp32 combine in slot order."""
    a = ids.shape[1]
    y = torch.cat([ex.expert(int(e), x[p // a][None]) for p, e in enumerate(ids.reshape(-1).tolist())])
    return finish.combine(y, weights)


def _fuse_on_the_cpu(moe: KimiMoE, monkeypatch) -> None:
    """Let the fusion run on the CPU: the experts claim the tiled layout (their codes stay in the checkpoint
    layout the CPU kernels read) and grouped launches served by `_grouped_on_the_cpu`."""
    sch = moe.experts.scheme
    assert moe.shared_fusion_blocker() is not None  # the CPU has no grouped launches: nothing fused
    sch.tiled = True
    assert moe.shared_fusion_blocker() is None
    moe.fuse_shared()
    monkeypatch.setattr(sch, "grouped_ok", lambda ex, x: True)
    monkeypatch.setattr(sch, "grouped", _grouped_on_the_cpu)


@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_fused_shared_expert_equals_the_separate_one(act_name: str, monkeypatch) -> None:
    """fp32, the kernel path's fp32 CPU reference: the fused block (shared expert as pick A) equals the
    separate shared MLP plus the routed sum up to fp32 summation order (RTOL[fp32]); the appended expert
    alone equals the shared MLP the same way; a wrong decode scale on it is caught."""
    with override_knobs(moe_fuse_shared=8):  # 5 tokens fused, whatever the default
        moe, g = _moe(act_name, "cpu", torch.float32)
        _process(moe, force_kernels=True)
        x = torch.randn(5, 256, generator=g)
        separate = moe(x)
        shared_alone = moe.shared_experts(x)
        _fuse_on_the_cpu(moe, monkeypatch)
        assert moe.shared_index == 6 and moe.experts.num_stacked == 7 and moe.experts.num_local == 6
        assert_close("appended expert", shared_alone, moe.experts.expert(6, x), rtol=RTOL[torch.float32])
        fused = moe(x)
        assert_close(f"fused shared expert {act_name}", separate, fused, rtol=RTOL[torch.float32])
        assert rel_rms_error(separate, fused - shared_alone) > 0.1  # the shared expert is a real part of it
        gs13, gs2 = moe.experts.scheme.kernel_scales
        gs2[6] *= 2  # the shared down projection's decode scale doubled
        assert rel_rms_error(separate, moe(x)) > 1e-2


def test_prefill_sizes_and_fp32_keep_the_separate_shared_expert(monkeypatch) -> None:
    """Above K3RUN_MOE_FUSE_SHARED tokens the block runs the shared MLP itself: the grouped launches see
    only the routed picks."""
    from k3run.knobs import knobs

    MAX = knobs().moe_fuse_shared
    assert MAX == 4

    moe, g = _moe("silu", "cpu", torch.float32, d=128, i=128, e=3)
    _process(moe, force_kernels=True)
    _fuse_on_the_cpu(moe, monkeypatch)
    seen = []
    grouped = moe.experts.scheme.grouped
    monkeypatch.setattr(
        moe.experts.scheme, "grouped", lambda ex, x, ids, w, f: seen.append(ids) or grouped(ex, x, ids, w, f)
    )
    moe(torch.randn(MAX + 1, 128, generator=g))
    moe(torch.randn(MAX, 128, generator=g))
    assert [tuple(ids.shape) for ids in seen] == [(MAX + 1, 2), (MAX, 3)]
    assert bool((seen[1][:, 2] == 3).all())


def test_fusion_blockers_are_named() -> None:
    """What keeps the shared expert apart is said in words; the loader's processing leaves it apart then."""
    moe, _ = _moe("silu", "cpu", torch.float32, d=128, i=128, e=3)
    _process(moe)
    assert moe.shared_index is None
    assert "no grouped NVFP4 launches" in (moe.shared_fusion_blocker() or "")
    moe.experts.scheme.tiled = True
    moe.experts.scheme.kernels = True
    moe.shared_experts.activation = ACTS["situ"]
    assert "activation" in (moe.shared_fusion_blocker() or "")
    with pytest.raises(
        ValueError, match="mlp: the shared expert cannot join the routed experts: shared expert activation"
    ):
        moe.fuse_shared()


def _gpu_moe(act_name: str, fuse: bool):
    with override_knobs(moe_fuse_shared=8 if fuse else 0):
        moe, g = _moe(act_name, "cuda", torch.bfloat16)
        _process(moe)
    if not moe.experts.scheme.tiled:
        pytest.skip("the grouped launches read the tiled128 layout (sm_89+)")
    return moe, g


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["silu", "situ"])
def test_gpu_fused_shared_expert_matches_the_separate_one(act_name: str) -> None:
    """bf16 on the GPU, at 1 token (one program per pick) and 5 / 8 tokens (expert-major): the fused block
    against the same weights with the shared expert apart. The two differ by where the shared output joins
    (the fp32 sum, rounded once, against the rounded routed sum plus the shared output, rounded again) and
    by the shared expert's fp32 summation order (its bf16 output one ulp apart at most): a few bf16
    roundings, RTOL[bf16]. Also in a CUDA graph, where the replay equals the eager call bit for bit."""
    fused, g = _gpu_moe(act_name, True)
    apart, _ = _gpu_moe(act_name, False)
    assert fused.shared_index == 6 and apart.shared_index is None
    for t in (1, 5, 8):
        x = (torch.randn(t, 256, generator=g) * 2).to("cuda", torch.bfloat16)
        assert_close(f"fused shared, {t} tokens", apart(x), fused(x), rtol=RTOL[torch.bfloat16])
    x = (torch.randn(8, 256, generator=g) * 2).to("cuda", torch.bfloat16)
    eager = fused(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(x)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = fused(x, sync_free=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_fused_up_to_128_tokens_and_identical_rows() -> None:
    """With the fusion allowed up to 128 tokens (K3RUN_MOE_FUSE_SHARED=128): at 12 / 20 / 24 tokens the
    expert-major launch runs at its 16-token tile with the shared expert in two groups (the path the default
    of 8 keeps out); against the shared expert apart within RTOL[bf16] (as above). And identical input rows
    give bit-identical output rows, fused and apart (each row's arithmetic does not depend on its
    neighbours): the property the full-depth random model's collapsed routing rests on."""
    fused, g = _gpu_moe("silu", True)
    apart, _ = _gpu_moe("silu", False)
    with override_knobs(moe_fuse_shared=128):
        for t in (8, 12, 20, 24):
            x = (torch.randn(t, 256, generator=g) * 2).to("cuda", torch.bfloat16)
            assert_close(f"fused shared, {t} tokens", apart(x), fused(x), rtol=RTOL[torch.bfloat16])
            same = x[:1].expand(t, -1).contiguous()
            for name, moe in (("fused", fused), ("apart", apart)):
                y = moe(same)
                assert bool((y == y[:1]).all()), f"{name}, {t} identical rows: outputs differ between rows"
