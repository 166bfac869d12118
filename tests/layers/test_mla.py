"""KimiMLA vs a reference written from kimi-architecture.md §3: expanded and absorbed forms, caches, TP."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from k3run.distributed import NO_TP, TPInfo
from k3run.formats import dequantize_fp8_block, quantize_fp8_block
from k3run.layers.mla import KimiMLA
from k3run.quant.algo import QuantAlgo
from k3run.quant.modelopt import ModelOptConfig
from k3run.quant.schemes import fp8_block_gemm_reference
from k3run.testing import RTOL, assert_close
from tests.gloo import spawn_gloo
from tests.step_schedule import ctx_for, feed_in_steps

D, H, DN, R, DV = 37, 4, 12, 6, 10
EPS = 1e-6
PREFIX = "model.layers.3.self_attn"
# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# fp32: a few projections and a softmax over <= 40 keys, each adding a few 2^-24 roundings; 1e-5 relative
# leaves a wide margin (measured ~1e-7) while a wrong formula is off by O(1)
VARIANTS = {"k3": (24, True), "kimi_linear": (None, False)}  # (q_lora_rank, use_output_gate)


def make_weights(variant: str, L: int = 20, seed: int = 1) -> dict[str, torch.Tensor]:
    q_lora, gate = VARIANTS[variant]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    w = {
        "kv_a_proj_with_mqa": rnd(L + R, D, scale=D**-0.5),
        "kv_a_layernorm": 1 + rnd(L, scale=0.3),
        "kv_b_proj": rnd(H * (DN + DV), L, scale=L**-0.5),
        "o_proj": rnd(D, H * DV, scale=(H * DV) ** -0.5),
    }
    # queries 3x larger than unit scale so the softmax is far from uniform
    if q_lora is not None:
        w["q_a_proj"] = rnd(q_lora, D, scale=D**-0.5)
        w["q_a_layernorm"] = 1 + rnd(q_lora, scale=0.3)
        w["q_b_proj"] = rnd(H * (DN + R), q_lora, scale=3 * q_lora**-0.5)
    else:
        w["q_proj"] = rnd(H * (DN + R), D, scale=3 * D**-0.5)
    if gate:
        w["g_proj"] = rnd(H * DV, D, scale=D**-0.5)
    return w


def make_layer(
    variant: str,
    w: dict[str, torch.Tensor],
    tp: TPInfo = NO_TP,
    dtype: torch.dtype = torch.float32,
    absorb: str = "decode",
    qcfg: ModelOptConfig | None = None,
    loaded: dict[str, tuple[torch.Tensor, ...]] | None = None,
) -> KimiMLA:
    """Build and load a layer; `loaded` overrides a linear's tensors (e.g. fp8 weight + scale)."""
    q_lora, gate = VARIANTS[variant]
    L = w["kv_b_proj"].shape[1]
    layer = KimiMLA(
        D, H, q_lora_rank=q_lora, kv_lora_rank=L, qk_nope_head_dim=DN, qk_rope_head_dim=R, v_head_dim=DV,
        use_output_gate=gate, latent_norm_eps=EPS, absorb=absorb, qcfg=qcfg, prefix=PREFIX, tp=tp,
        params_dtype=dtype,
    )  # fmt: skip
    loaded = loaded or {}
    for name, t in w.items():
        module = getattr(layer, name)
        if name in loaded:
            for pname, tensor in zip(("weight", "weight_scale"), loaded[name], strict=True):
                param = getattr(module, pname)
                param.weight_loader(param, tensor)
        else:
            module.weight.weight_loader(module.weight, t)
        if hasattr(module, "unfilled_parameters"):
            assert module.unfilled_parameters() == []
    for module in layer.modules():
        if hasattr(module, "scheme"):
            module.process_after_loading()
    layer.process_after_loading()
    return layer


def reference(
    variant: str,
    w: dict[str, torch.Tensor],
    x: torch.Tensor,
    kv_b: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One whole sequence x [T, D] -> [T, D], expanded MHA straight from the spec, fp32.

    kv_b: replaces the plain kv_b_proj GEMM (e.g. by the FP8_PB_WO reference that also quantizes its input).
    """
    q_lora, gate = VARIANTS[variant]
    L = w["kv_b_proj"].shape[1]
    x = x.float()
    T = x.shape[0]

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * weight

    if q_lora is not None:
        q = rms(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T
    else:
        q = x @ w["q_proj"].T
    q = q.reshape(T, H, DN + R)
    kv_a = x @ w["kv_a_proj_with_mqa"].T
    c, k_pe = rms(kv_a[:, :L], w["kv_a_layernorm"]), kv_a[:, L:]
    kv = (c @ w["kv_b_proj"].T if kv_b is None else kv_b(c)).reshape(T, H, DN + DV)
    k = torch.cat([kv[..., :DN], k_pe[:, None, :].expand(T, H, R)], dim=-1)  # k_pe shared, not rotated
    scores = torch.einsum("thd,shd->hts", q, k) * (DN + R) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., DN:])
    if gate:
        o = o * torch.sigmoid((x @ w["g_proj"].T).reshape(T, H, DV))
    return o.reshape(T, H * DV) @ w["o_proj"].T


def run_schedule(
    layer: KimiMLA, xs: list[torch.Tensor], steps: list[list[int]], slots: list[int], max_len: int = 40
) -> list[torch.Tensor]:
    """`feed_in_steps` over a 4-slot, max_len-token cache that starts out holding noise."""
    cache = layer.init_cache(4, max_len, xs[0].dtype, "cpu")
    cache.latent.normal_()  # stale latents beyond a sequence's length must never be read
    return feed_in_steps(layer, cache, xs, steps, slots)


SCHEDULE = [[20, 0, 1], [7, 9, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]]  # chunked prefill + decode


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(31, D), torch.randn(12, D), torch.randn(2, D)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_matches_reference(variant: str, poison_empty: None) -> None:
    w = make_weights(variant)
    layer = make_layer(variant, w)
    xs = [torch.randn(23, D), torch.randn(5, D)]
    y = layer(torch.cat(xs), ctx_for([23, 5], [0, 0], None), None)
    assert_close("seq 0", reference(variant, w, xs[0]), y[:23], rtol=RTOL[torch.float32])
    assert_close("seq 1", reference(variant, w, xs[1]), y[23:], rtol=RTOL[torch.float32])


@pytest.mark.parametrize("absorb", ["decode", "always", "never"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_full_sequence(variant: str, absorb: str) -> None:
    w = make_weights(variant)
    layer = make_layer(variant, w, absorb=absorb)
    xs = _inputs()
    outs = run_schedule(layer, xs, SCHEDULE, slots=[2, 0, 3])
    for b, x in enumerate(xs):
        assert_close(f"{absorb} seq {b}", reference(variant, w, x), outs[b], rtol=RTOL[torch.float32])


def test_absorbed_decode_equals_expanded_bf16() -> None:
    w = make_weights("k3")
    xs = [x.bfloat16() for x in _inputs()]
    naive = run_schedule(make_layer("k3", w, dtype=torch.bfloat16, absorb="never"), xs, SCHEDULE, [2, 0, 3])
    absorbed = run_schedule(
        make_layer("k3", w, dtype=torch.bfloat16, absorb="decode"), xs, SCHEDULE, [2, 0, 3]
    )
    for b, x in enumerate(xs):
        ref = reference("k3", w, x.float())
        # bf16 keeps 8 mantissa bits (<= 2^-9 relative per rounding, RMS ~1.1e-3). Weights, input, the q,
        # latent and gate projections, kv_b's output (expanded form only) and o_proj's output are rounded:
        # ~8 roundings -> ~1e-2 at most; measured 5e-3..8e-3. The two forms differ only by kv_b's rounding.
        assert_close(f"bf16 expanded seq {b}", ref, naive[b], rtol=2e-2)
        assert_close(f"bf16 absorbed seq {b}", ref, absorbed[b], rtol=2e-2)
        assert_close(f"bf16 absorbed vs expanded seq {b}", naive[b].float(), absorbed[b], rtol=1e-2)
    assert absorbed[0].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_fused_attention_prefill_matches_the_fp32_form(variant: str, monkeypatch) -> None:
    """On CUDA with bf16 the expanded form runs torch's fused attention (bottom-right causal for chunks
    after a context). Against the same layer with the fp32 form, over chunked prefill and decode: the inputs
    are the same bf16 values; the fused kernels round the probabilities to bf16 for the PV product (<= 2^-9
    relative each) and their output to bf16 (2^-9), so the layer outputs differ by ~2^-8 RMS at most; 2^-7
    bounds it while a masking or scaling slip is O(1)."""
    w = make_weights(variant)
    with torch.device("cuda"):
        layer = make_layer(variant, w, dtype=torch.bfloat16, absorb="never")
    xs = [x.bfloat16().cuda() for x in _inputs()]

    def run() -> list[torch.Tensor]:
        cache = layer.init_cache(4, 40, torch.bfloat16, "cuda")
        cache.latent.normal_()
        return feed_in_steps(layer, cache, xs, SCHEDULE, [2, 0, 3])

    fused = run()
    monkeypatch.setattr(layer, "_attend_flash", layer._attend_expanded_fp32)
    fp32 = run()
    for b in range(len(xs)):
        assert_close(f"{variant} fused vs fp32 seq {b}", fp32[b].float(), fused[b], rtol=2.0**-7)
        assert_close(
            f"{variant} fused vs reference seq {b}",
            reference(variant, w, xs[b].float().cpu()),
            fused[b],
            rtol=2e-2,
        )


def test_kv_b_proj_fp8_pb_wo_gets_activation_dtype_and_dequantized_absorption() -> None:
    L = 128  # FP8_PB_WO needs the input width to be a multiple of 128
    w = make_weights("k3", L=L)
    q8, s8 = quantize_fp8_block(w["kv_b_proj"])
    w_deq = dict(w, kv_b_proj=dequantize_fp8_block(q8, s8))
    qcfg = ModelOptConfig(
        quant_algo="MIXED_PRECISION", quantized_layers={f"{PREFIX}.kv_b_proj": QuantAlgo.FP8_PB_WO}
    )
    xs = _inputs()

    def fp8_layer(dtype: torch.dtype, absorb: str) -> KimiMLA:
        return make_layer("k3", w, dtype=dtype, absorb=absorb, qcfg=qcfg, loaded={"kv_b_proj": (q8, s8)})

    # absorbed everywhere: exactly the dequantized weight, applied to the unquantized latent
    layer = fp8_layer(torch.float32, "always")
    assert layer.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.kv_b_proj.dequantized_weight(), w_deq["kv_b_proj"])
    assert torch.equal(layer.w_uk, w_deq["kv_b_proj"].reshape(H, DN + DV, L)[:, :DN])
    outs = run_schedule(layer, xs, SCHEDULE, [2, 0, 3])
    for b, x in enumerate(xs):
        assert_close(
            f"fp8 kv_b absorbed seq {b}", reference("k3", w_deq, x), outs[b], rtol=RTOL[torch.float32]
        )

    # expanded everywhere: kv_b_proj quantizes its own (fp32 here) latent input per token and 128 columns
    outs = run_schedule(fp8_layer(torch.float32, "never"), xs, SCHEDULE, [2, 0, 3])
    for b, x in enumerate(xs):
        ref = reference("k3", w, x, kv_b=lambda c: fp8_block_gemm_reference(c, q8, s8))
        assert_close(f"fp8 kv_b expanded seq {b}", ref, outs[b], rtol=RTOL[torch.float32])

    # bf16 activations: the latent reaches kv_b_proj in bf16, never in the fp8 weight dtype
    layer = fp8_layer(torch.bfloat16, "decode")
    assert layer.kv_b_input_dtype() == torch.bfloat16
    outs = run_schedule(layer, [x.bfloat16() for x in xs], SCHEDULE, [2, 0, 3])
    for b, x in enumerate(xs):
        # the prefill tokens see the fp8 activation rounding of the latent (e4m3: 3 mantissa bits, <= 2^-4
        # relative, RMS ~3% per element, carried ~1:1 into k_nope and v) on top of bf16 roundings;
        # measured 2.6e-2..3.4e-2
        assert_close(
            f"fp8 kv_b bf16 seq {b}", reference("k3", w_deq, x.bfloat16().float()), outs[b], rtol=8e-2
        )
    plain = make_layer("k3", w, dtype=torch.bfloat16)
    assert plain.kv_b_input_dtype() == torch.bfloat16 == plain.kv_b_proj.weight.dtype


def test_errors_are_named() -> None:
    w = make_weights("kimi_linear")
    layer = make_layer("kimi_linear", w)
    with pytest.raises(ValueError, match="context_lens \\[4\\] need an MLA cache"):
        layer(torch.randn(1, D), ctx_for([1], [4], None), None)
    cache = layer.init_cache(2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs 9 cached tokens, the cache holds 8"):
        layer(torch.randn(2, D), ctx_for([2], [7], [1]), cache)
    fresh = KimiMLA(
        D, H, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=DN, qk_rope_head_dim=R, v_head_dim=DV,
        use_output_gate=False, absorb="always", params_dtype=torch.float32, prefix="M",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="M: call process_after_loading"):
        fresh(torch.randn(2, D), ctx_for([2], [0], None), None)


def _tp_worker(
    tp: TPInfo, variant: str, w: dict[str, torch.Tensor], xs: list[torch.Tensor]
) -> list[torch.Tensor]:
    layer = make_layer(variant, w, tp=tp)
    assert layer.local_heads == H // tp.size and layer.kv_a_proj_with_mqa.weight.shape[0] == 20 + R
    return run_schedule(layer, xs, [[9, 4], [1, 3], [1, 1]], slots=[0, 1])


def test_tensor_parallel_2_equals_1() -> None:
    xs = [torch.randn(11, D), torch.randn(8, D)]
    for variant in VARIANTS:
        w = make_weights(variant, seed=3)
        single = _tp_worker(NO_TP, variant, w, xs)
        ranks = spawn_gloo(_tp_worker, 2, variant, w, xs)
        for r, outs in enumerate(ranks):
            for b in range(len(xs)):
                # per-rank partial o_proj products are summed by the all-reduce in another order: fp32 noise
                assert_close(f"{variant} rank {r} seq {b}", single[b], outs[b], rtol=RTOL[torch.float32])
