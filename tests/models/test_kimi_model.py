"""Whole tiny random Kimi Linear and K3 models: prefill-then-decode equals one full forward, TP=2 equals
TP=1, and the checkpoint-name table on both namings."""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3run.api import load_model
from k3run.distributed import TPInfo
from k3run.formats import dequantize_nvfp4
from k3run.forward_context import ForwardContext
from k3run.loader import LoadError
from k3run.quant.export import quantize_checkpoint
from k3run.testing import assert_close, noise_floor_rtol
from tests.gloo import spawn_gloo
from tests.model_builders import K3, KIMI_LINEAR, VOCAB, random_checkpoint, random_linear, write_checkpoint

VARIANTS = {"kimi_linear": KIMI_LINEAR, "k3": K3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_kimi")
    out = {name: write_checkpoint(root / name, hf, seed) for seed, (name, hf) in enumerate(VARIANTS.items())}
    # K3 as nvidia/Kimi-K3-NVFP4 is laid out: NVFP4 routed experts, modelopt_mixed config with
    # quantized_layers under language_model.model... names (attention stays bf16 here: K=64 is not a
    # multiple of the 128 FP8_PB_WO needs, and the exporter keeps such layers in bf16 with a warning)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_checkpoint(out["k3"], root / "k3_mixed", "k3-mixed", progress=False)
    out["k3_mixed"] = root / "k3_mixed"
    return out


def _step(model, ids: list[torch.Tensor], context: list[int], slots: list[int], cache) -> list[torch.Tensor]:
    """One engine-style step over a flat batch; returns each sequence's logits for its new tokens."""
    lens = [len(x) for x in ids]
    ctx = ForwardContext(
        cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        context_lens=torch.tensor(context),
        slots=torch.tensor(slots),
        cache=cache,
    )
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(ids), ctx))
    return list(logits.split(lens))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_equals_full_forward(checkpoints, variant):
    model = load_model(checkpoints[variant])
    assert model.params_dtype == torch.float32
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (10, 6)]
    full = [model.logits(s) for s in seqs]

    cache = model.make_cache(num_slots=3, max_len=16)
    slots = [2, 0]
    # steps: a batched prefill, a mixed chunk continuing both sequences (context > 0, several tokens),
    # then batched single-token decode steps; sequence 1 finishes early and leaves the batch
    plan = [(4, 2), (2, 1)] + [(1, 1)] * 3 + [(1, 0)]
    pos = [0, 0]
    got: list[list[torch.Tensor]] = [[], []]
    for take in plan:
        active = [b for b in (0, 1) if take[b] and pos[b] < len(seqs[b])]
        out = _step(
            model,
            [seqs[b][pos[b] : pos[b] + take[b]] for b in active],
            [pos[b] for b in active],
            [slots[b] for b in active],
            cache,
        )
        for b, o in zip(active, out, strict=True):
            got[b].append(o)
            pos[b] += take[b]
    assert pos == [10, 6]
    for b in (0, 1):
        # fp32 throughout: the chunked vs recurrent KDA forms and the absorbed vs expanded MLA forms agree
        # to ~1e-7 relative per layer; 1e-5 leaves room for the layers to compound it
        assert_close(f"{variant} seq {b} cached vs full", full[b], torch.cat(got[b]), rtol=1e-5)


@pytest.mark.parametrize("variant", ["kimi_linear", "k3", "k3_mixed"])
def test_static_decode_step_equals_the_eager_step(checkpoints, variant):
    """The decode step a CUDA graph captures (ForwardContext.attn_window: MLA attends over a fixed window of
    each slot, masked by context_lens; KDA zeroes fresh rows with a device mask; the MoE takes its
    host-sync-free dense path) gives the eager step's logits and leaves the same cache, on CPU, including
    a fresh sequence whose slot still holds a previous owner's state."""
    model = load_model(checkpoints[variant])
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 4)]
    cache = model.make_cache(num_slots=4, max_len=24)
    for layer in cache.layers:  # slot 3 holds stale state of an earlier sequence
        for t in vars(layer).values():
            t[3] = torch.randn(t[3].shape, generator=g).to(t.dtype)
    _step(model, prompts, [0, 0], [2, 0], cache)
    static_cache = copy.deepcopy(cache)
    new = [torch.randint(0, VOCAB, (1,), generator=g) for _ in range(3)]
    context, slots = [9, 4, 0], [2, 0, 3]  # the third sequence feeds its first token
    want = torch.cat(_step(model, new, context, slots, cache))
    ctx = ForwardContext(
        cu_seqlens=torch.arange(4),
        context_lens=torch.tensor(context),
        slots=torch.tensor(slots),
        cache=static_cache,
        attn_window=16,  # < max_len: the window, not the whole slot
    )
    assert ctx.sync_free  # the MoE layers take their host-sync-free paths
    with torch.no_grad():
        got = model.compute_logits(model(torch.cat(new), ctx))
    # fp32: the masked window sums the same terms as the per-sequence attention in another order (~1e-7)
    assert_close(f"{variant} static vs eager decode", want, got, rtol=1e-5)
    for i, (a, b) in enumerate(zip(cache.layers, static_cache.layers, strict=True)):
        for name in vars(a):
            want_c, got_c = getattr(a, name)[:3].float(), getattr(b, name)[:3].float()
            assert_close(f"layer {i} cache {name}", want_c, got_c, rtol=1e-5)


def test_static_context_checks():
    with pytest.raises(ValueError, match="attn_window"):
        ForwardContext(cu_seqlens=torch.arange(2), context_lens=torch.zeros(1), attn_window=0)
    with pytest.raises(ValueError, match="takes no seqlens_list"):
        ForwardContext(
            cu_seqlens=torch.tensor([0, 2]), context_lens=torch.zeros(1), seqlens_list=[2], attn_window=8
        )
    static = ForwardContext(cu_seqlens=torch.arange(4), context_lens=torch.zeros(3), attn_window=8)
    assert static.num_seqs == 3 and static.num_tokens == 3 and static.is_decode
    with pytest.raises(RuntimeError, match="no host copy"):
        static.bounds()


def test_host_offsets_follow_the_lengths_and_are_built_once():
    cu = torch.tensor([0, 3, 3, 10])
    ctx = ForwardContext(cu_seqlens=cu, context_lens=torch.zeros(3, dtype=torch.long))
    host = ctx.cu_seqlens_host()
    assert torch.equal(host, cu) and host.device.type == "cpu" and host.dtype == torch.int64
    assert ctx.cu_seqlens_host() is host  # one object per step: fla's index caches key on identity


def _tp_logits(tp: TPInfo, ckpt_dirs: list[str], ids: torch.Tensor) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    out = []
    for d in ckpt_dirs:
        model = load_model(d, tp_rank=tp.rank, tp_size=tp.size)
        cache = model.make_cache(num_slots=1, max_len=len(ids))
        # prefill all but the last token, then one decode step, so the TP cache path runs too
        first = _step(model, [ids[:-1]], [0], [0], cache)[0]
        last = _step(model, [ids[-1:]], [len(ids) - 1], [0], cache)[0]
        out.append(torch.cat([first, last]))
    return out


def test_tp2_equals_tp1(checkpoints):
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(3))
    names = [*VARIANTS, "k3_mixed"]  # the quantized K3 splits its NVFP4 experts and their scales over ranks
    dirs = [str(checkpoints[v]) for v in names]
    ranks = spawn_gloo(_tp_logits, 2, dirs, ids)
    for name, d, r0, r1 in zip(names, dirs, ranks[0], ranks[1], strict=True):
        ref = load_model(d).logits(ids)
        assert torch.equal(r0, r1)  # gathered logits are identical on every rank
        # experts split over ranks (EP) and sharded GEMMs change fp32 summation order only
        assert_close(f"{name} TP=2 vs TP=1", ref, r0, rtol=1e-5)


def test_checkpoint_errors_name_the_tensor(checkpoints, tmp_path):
    hf = json.loads((checkpoints["kimi_linear"] / "config.json").read_text())
    tensors = random_checkpoint(hf, 0)
    tensors["model.layers.1.block_sparse_moe.experts.0.w1.weight"] = random_linear(torch.Generator(), 32, 48)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    # refused from the headers, before the model is built, in checkpoint names (k3run.checks)
    with pytest.raises(
        LoadError,
        match=r"config hidden_size = 64 but tensor model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\."
        r"weight has shape \[32, 48\]; expected \[32, 64\]",
    ):
        load_model(tmp_path)
    del tensors["model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    tensors["model.layers.1.block_sparse_moe.experts.9.w1.weight"] = random_linear(torch.Generator(), 32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        LoadError, match=r"config num_experts = \d+ but the checkpoint has tensor \S+experts\.9\.w1"
    ):
        load_model(tmp_path)
    del tensors["model.layers.1.block_sparse_moe.experts.9.w1.weight"]
    tensors["model.layers.1.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadError, match=r"tensor model\.layers\.1\.self_attn\.mystery\.weight: a model with"):
        load_model(tmp_path)
    del tensors["model.layers.1.self_attn.mystery.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        LoadError, match=r"tensor model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight is missing"
    ):
        load_model(tmp_path)


def test_checkpoint_name_table_both_namings():
    from k3run.config import ModelConfig
    from k3run.loader import IGNORE, Target
    from k3run.models.kimi import KimiForCausalLM

    kl = KimiForCausalLM(ModelConfig.from_hf(KIMI_LINEAR), params_dtype=torch.float32)
    k3 = KimiForCausalLM(ModelConfig.from_hf(K3), params_dtype=torch.float32)
    cases = [
        # original naming
        (kl, "model.layers.0.self_attn.k_proj.weight", Target("layers.0.self_attn.in_proj.weight", 1)),
        (kl, "model.layers.0.self_attn.b_proj.weight", Target("layers.0.self_attn.in_proj.weight", 3)),
        (kl, "model.layers.0.self_attn.f_a_proj.weight", Target("layers.0.self_attn.in_proj.weight", 4)),
        (kl, "model.layers.0.self_attn.v_conv1d.weight", Target("layers.0.self_attn.conv_weight", 2)),
        (kl, "model.layers.0.self_attn.A_log", Target("layers.0.self_attn.A_log")),
        (kl, "model.layers.2.self_attn.q_proj.weight", Target("layers.2.self_attn.q_proj.weight")),  # MLA
        (kl, "model.layers.0.mlp.up_proj.weight", Target("layers.0.mlp.gate_up_proj.weight", 1)),
        (
            kl,
            "model.layers.1.block_sparse_moe.experts.5.w3.weight",
            Target("layers.1.mlp.experts.w13_weight", (5, "w3")),
        ),
        (
            kl,
            "model.layers.1.block_sparse_moe.experts.5.w2.weight",
            Target("layers.1.mlp.experts.w2_weight", (5, "w2")),
        ),
        (
            kl,
            "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
            Target("layers.1.mlp.shared_experts.gate_up_proj.weight", 0),
        ),
        # transformers-5 / ModelOpt naming
        (kl, "model.layers.0.self_attn.conv1d.weight", Target("layers.0.self_attn.conv_weight", None)),
        (
            kl,
            "model.layers.0.self_attn.forget_gate.f_a_proj.weight_scale",
            Target("layers.0.self_attn.in_proj.weight_scale", 4),
        ),
        (
            kl,
            "model.layers.0.self_attn.forget_gate.f_b_proj.weight",
            Target("layers.0.self_attn.f_b_proj.weight"),
        ),
        (kl, "model.layers.0.self_attn.forget_gate.dt_bias", Target("layers.0.self_attn.dt_bias")),
        (
            kl,
            "model.layers.3.mlp.experts.7.up_proj.weight_scale_2",
            Target("layers.3.mlp.experts.w13_weight_scale_2", (7, "w3")),
        ),
        (
            kl,
            "model.layers.3.mlp.gate.e_score_correction_bias",
            Target("layers.3.mlp.gate.e_score_correction_bias"),
        ),
        # K3 (language_model. root, full-rank gate shard order, AttnRes, latent MoE)
        (
            k3,
            "language_model.model.layers.1.self_attn.g_proj.weight",
            Target("layers.1.self_attn.in_proj.weight", 3),
        ),
        (
            k3,
            "language_model.model.layers.1.self_attn.b_proj.weight",
            Target("layers.1.self_attn.in_proj.weight", 5),
        ),
        (
            k3,
            "language_model.model.layers.3.self_attn.g_proj.weight",
            Target("layers.3.self_attn.g_proj.weight"),
        ),
        (k3, "language_model.model.layers.2.mlp_res_proj.weight", Target("layers.2.mlp_res.proj_weight")),
        (k3, "language_model.model.output_attn_res_norm.weight", Target("output_attn_res.norm_weight")),
        (
            k3,
            "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
            Target("layers.1.mlp.routed_expert_norm.weight"),
        ),
        (k3, "language_model.lm_head.weight", Target("lm_head.weight")),
    ]
    params = {
        id(kl): dict(kl.named_parameters()),
        id(k3): dict(k3.named_parameters()),
    }
    for model, name, target in cases:
        assert model.checkpoint_mapping(name) == [target], name
        # these models are unquantized: scale tensors have a destination only in quantized ones
        if "scale" not in name:
            assert target.param in params[id(model)], target
    assert k3.checkpoint_mapping("vision_tower.encoder.blocks.0.wo.weight") == IGNORE
    assert kl.checkpoint_mapping("model.layers.2.self_attn.conv1d.weight") is None  # MLA layer has no conv


def _k3_reference_logits(
    hf: dict, t: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The K3 decoder written out from kimi-architecture.md §2-§4 in fp64 (or `dtype`, for its own rounding
    noise), token by token, straight from the checkpoint tensors (original names): an independent check of
    the whole assembly (AttnRes wiring, latent MoE, SiTU, full-rank KDA gate with lower bound, q_lora MLA with
    output gate)."""
    c = hf["text_config"]
    r = "language_model.model."
    w = {k.removeprefix(r): v.to(dtype) for k, v in t.items()}
    eps, n_tok = c["rms_norm_eps"], len(ids)
    lin = c["linear_attn_config"]
    H, K = lin["num_heads"], lin["head_dim"]

    def rms(x, weight=None, e=eps):
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + e)
        return y if weight is None else y * weight

    def situ(gu):
        g, u = gu.chunk(2, dim=-1)
        return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)

    def gated(x, gate, up, down):
        return situ(torch.cat([x @ gate.t(), x @ up.t()], -1)) @ down.t()

    def mlp(p, x):
        return gated(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])

    def mlp_w(p, x):  # routed experts use the original w1 (gate) / w3 (up) / w2 (down) names
        return gated(x, w[p + "w1.weight"], w[p + "w3.weight"], w[p + "w2.weight"])

    def kda(p, x):
        proj = {n: x @ w[p + f"{n}_proj.weight"].t() for n in "qkvgb"}
        conv = {}
        for n in "qkv":
            cw = w[p + f"{n}_conv1d.weight"][:, 0]  # [P, W]
            pad = torch.cat([torch.zeros(cw.shape[1] - 1, cw.shape[0], dtype=dtype), proj[n]])
            conv[n] = torch.nn.functional.silu(
                torch.stack([(pad[i : i + cw.shape[1]].t() * cw).sum(-1) for i in range(n_tok)])
            ).view(n_tok, H, K)
        q = conv["q"] / torch.sqrt((conv["q"] ** 2).sum(-1, keepdim=True) + 1e-6) * K**-0.5
        k = conv["k"] / torch.sqrt((conv["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
        f = (x @ w[p + "f_a_proj.weight"].t() @ w[p + "f_b_proj.weight"].t()).view(n_tok, H, K)
        a = torch.exp(w[p + "A_log"]).view(1, H, 1)
        g = c["gate_lower_bound"] * torch.sigmoid(a * (f + w[p + "dt_bias"].view(1, H, K)))
        beta = torch.sigmoid(proj["b"])
        s = torch.zeros(H, K, K, dtype=dtype)
        outs = []
        for i in range(n_tok):
            s = torch.exp(g[i]).unsqueeze(-1) * s
            err = conv["v"][i] - torch.einsum("hkv,hk->hv", s, k[i])
            s = s + beta[i].view(H, 1, 1) * torch.einsum("hk,hv->hkv", k[i], err)
            outs.append(torch.einsum("hkv,hk->hv", s, q[i]))
        o = rms(torch.stack(outs), w[p + "o_norm.weight"]) * torch.sigmoid(proj["g"].view(n_tok, H, K))
        return o.reshape(n_tok, H * K) @ w[p + "o_proj.weight"].t()

    def mla(p, x):
        nh, dn, dr, dv, L = (
            c[n]
            for n in (
                "num_attention_heads",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
                "kv_lora_rank",
            )
        )
        q = (
            rms(x @ w[p + "q_a_proj.weight"].t(), w[p + "q_a_layernorm.weight"], 1e-6)
            @ w[p + "q_b_proj.weight"].t()
        )
        q = q.view(n_tok, nh, dn + dr)
        kv = x @ w[p + "kv_a_proj_with_mqa.weight"].t()
        lat, kpe = rms(kv[:, :L], w[p + "kv_a_layernorm.weight"], 1e-6), kv[:, L:]
        kvb = (lat @ w[p + "kv_b_proj.weight"].t()).view(n_tok, nh, dn + dv)
        key = torch.cat([kvb[..., :dn], kpe.unsqueeze(1).expand(n_tok, nh, dr)], -1)
        scores = torch.einsum("ihd,jhd->hij", q, key) / math.sqrt(dn + dr)
        scores = scores.masked_fill(torch.ones(n_tok, n_tok).triu(1).bool(), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kvb[..., dn:]).reshape(n_tok, nh * dv)
        return (o * torch.sigmoid(x @ w[p + "g_proj.weight"].t())) @ w[p + "o_proj.weight"].t()

    def moe(p, x):
        s = torch.sigmoid(x @ w[p + "gate.weight"].t())
        z = x @ w[p + "routed_expert_down_proj.weight"].t()
        y = torch.zeros(n_tok, z.shape[1], dtype=dtype)
        for i in range(n_tok):
            top = (s[i] + w[p + "gate.e_score_correction_bias"]).topk(c["num_experts_per_token"]).indices
            for e, we in zip(top.tolist(), s[i, top] / s[i, top].sum(), strict=True):
                y[i] += we * mlp_w(p + f"experts.{e}.", z[i])
        y = rms(y, w[p + "routed_expert_norm.weight"]) @ w[p + "routed_expert_up_proj.weight"].t()
        return y + mlp(p + "shared_experts.", x)

    def mix(cands, site):
        v = torch.stack(cands)
        scores = rms(v) @ (w[site + "_norm.weight"] * w[site + "_proj.weight"][0])
        return (scores.softmax(0).unsqueeze(-1) * v).sum(0)

    blocks, prefix = [], w["embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        a_in = prefix if not blocks else mix([*blocks, prefix], p + "self_attention_res")
        if i % c["attn_res_block_size"] == 0:
            blocks, prefix = [*blocks, prefix], None
        x = rms(a_in, w[p + "input_layernorm.weight"])
        a = kda(p + "self_attn.", x) if i + 1 in lin["kda_layers"] else mla(p + "self_attn.", x)
        prefix = a if prefix is None else prefix + a
        x = rms(mix([*blocks, prefix], p + "mlp_res"), w[p + "post_attention_layernorm.weight"])
        prefix = prefix + (
            mlp(p + "mlp.", x) if i < c["first_k_dense_replace"] else moe(p + "block_sparse_moe.", x)
        )
    h = rms(mix([*blocks, prefix], "output_attn_res"), w["norm.weight"])
    return h @ t["language_model.lm_head.weight"].to(dtype).t()


def test_fused_residual_adds_give_the_plain_streams_bits(checkpoints):
    """The pre-norm stream's adds run inside the next norm (RMSNorm.add): bit for bit the plain stream
    h = h + mixer(norm(h)); h = h + mlp(norm(h)); final norm, in bf16 (where every add rounds)."""
    model = load_model(checkpoints["kimi_linear"], dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = model(ids, ForwardContext.single(7))
        ctx = ForwardContext.single(7)
        h = model.embed_tokens(ids)
        for layer in model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), ctx, None)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = model.norm(h)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # the check sees a slip: one layer's MLP output added twice
    with torch.no_grad():
        layer = model.layers[-1]
        slipped = model.norm(h + layer.mlp(layer.post_attention_layernorm(h)) * 0.01)
    assert not torch.equal(got, slipped)


def test_k3_matches_fp64_reference(checkpoints):
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(11))
    tensors = load_file(str(checkpoints["k3"] / "model.safetensors"))
    ref = _k3_reference_logits(K3, tensors, ids)
    out = load_model(checkpoints["k3"]).logits(ids)
    # fp32 model vs fp64 formula over 5 layers: the model's roundings are those of the same formula run in
    # fp32 in another order, so the bound is that fp32 run's own distance from fp64 (noise_floor_rtol); any
    # wiring slip (wrong candidate set, norm weight, gate, shard, routing) is O(1e-2) or larger
    rtol = noise_floor_rtol(ref, _k3_reference_logits(K3, tensors, ids, torch.float32))
    assert rtol < 1e-4, f"the fp32 formula itself is {rtol / 4:.2e} from fp64: the test lost its resolution"
    assert_close("K3 tiny model vs fp64 reference", ref, out, rtol=rtol)


def test_k3_mixed_export_matches_its_dequantized_weights(checkpoints, tmp_path):
    src = checkpoints["k3_mixed"]
    quant = load_model(src)
    experts = quant.layers[1].mlp.experts
    assert experts.algo.value == "NVFP4" and experts.w13_weight.dtype == torch.uint8
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(f))
    deq = {}
    for name, t in tensors.items():
        base, _, kind = name.rpartition(".")
        if kind == "weight" and t.dtype == torch.uint8:
            deq[name] = dequantize_nvfp4(
                t, tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_scale_2"]
            )
        elif kind not in ("weight_scale", "weight_scale_2", "input_scale"):
            deq[name] = t
    hf = json.loads((src / "config.json").read_text())
    hf.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(deq, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(5))
    # W4A16: the experts compute with exactly the dequantized weights (fp32 rounding order only)
    assert_close("k3-mixed vs dequantized", load_model(tmp_path).logits(ids), quant.logits(ids), rtol=1e-5)


def test_tied_word_embeddings(tmp_path):
    hf = {**KIMI_LINEAR, "tie_word_embeddings": True}
    tensors = random_checkpoint(hf, 4)  # still carries lm_head.weight: ignored, embed_tokens is the head
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.lm_head is None
    ids = torch.tensor([3, 1, 4, 1, 5])
    hidden = model(ids, ForwardContext.single(len(ids)))
    emb = tensors["model.embed_tokens.weight"].float()
    assert_close("tied head", hidden.detach() @ emb.t(), model.logits(ids), rtol=1e-6)


def test_float32_tensors_are_held_without_rounding(tmp_path, caplog):
    """K3 stores o_norm.weight, A_log, dt_bias, the convs and the router bias F32: a bf16 model holds them in
    fp32 (never rounded), says so at load and in inspect, and warns about a tensor it does round."""
    from k3run.quant.plan import build_quant_plan

    hf = copy.deepcopy(K3) | {"dtype": "bfloat16"}
    tensors = random_checkpoint(hf, 3)
    f32 = ("o_norm.weight", "A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")
    for name in list(tensors):
        if name.endswith(f32):
            # (1 + 2^-12) puts bits below bf16's 8-bit mantissa into every nonzero value
            tensors[name] = tensors[name].float() * (1 + 2**-12)
    norm = "language_model.model.layers.0.input_layernorm.weight"
    tensors[norm] = tensors[norm].float() * (1 + 2**-12)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level("INFO", logger="k3run.api"):
        model = load_model(tmp_path)
    o_norm = model.layers[0].self_attn.o_norm.weight
    assert o_norm.dtype == torch.float32
    assert torch.equal(o_norm, tensors["language_model.model.layers.0.self_attn.o_norm.weight"])
    log = caplog.text
    assert "language_model.model.layers.N.self_attn.o_norm.weight (F32 [32] x3) -> float32" in log
    assert "language_model.model.layers.N.self_attn.A_log (F32 [2] x3) -> float32" in log
    rounded = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in rounded] == [
        "checkpoint tensors rounded at load: "
        "language_model.model.layers.N.input_layernorm.weight (F32 [64]) -> bfloat16 (rounded)"
    ]
    table = build_quant_plan(tmp_path).format_table()
    assert "tensors held in another dtype than the model's bfloat16:" in table
    assert "layers.N.self_attn.o_norm.weight (F32 [32] x3) -> float32" in table
    assert "layers.N.input_layernorm.weight (F32 [64]) -> bfloat16 (rounded)" in table


def test_module_spellings_map_to_the_same_target():
    """Every spelling module_spellings gives for a checkpoint module (what quant configs are matched
    against) is a name the table maps to the same parameter and shard, and the other naming is among them."""
    from k3run.config import ModelConfig
    from k3run.models.kimi import KimiForCausalLM, module_spellings

    roots = ("language_model.model.", "model.language_model.", "model.", "language_model.lm_head", "lm_head")
    for hf in (KIMI_LINEAR, K3):
        model = KimiForCausalLM(ModelConfig.from_hf(hf), params_dtype=torch.float32)
        for name in random_checkpoint(hf, 0):
            prefix, _, last = name.rpartition(".")
            want = model.checkpoint_mapping(name)
            assert want, name
            spellings = module_spellings(prefix)
            assert spellings[0] == prefix
            for s in spellings:
                if s.startswith(roots):  # the other roots are config-only spellings, not tensor names
                    assert model.checkpoint_mapping(f"{s}.{last}") == want, (name, s)
    both = module_spellings("model.layers.0.self_attn.f_a_proj")
    assert (
        "language_model.model.layers.0.self_attn.forget_gate.f_a_proj" in both
        and "layers.0.self_attn.f_a_proj" in both
    )
    experts = module_spellings("language_model.model.layers.1.block_sparse_moe.experts.7.w3")
    assert "model.layers.1.mlp.experts.7.up_proj" in experts and "layers.1.mlp.experts.7.w3" in experts
    assert module_spellings("language_model.lm_head") == ("language_model.lm_head", "lm_head")
    # forget_gate. is the transformers-5 home of the forget-gate modules only
    assert "model.layers.0.self_attn.forget_gate.q_proj" not in module_spellings(
        "model.layers.0.self_attn.q_proj"
    )


def _wide(hf: dict) -> dict:
    """The tiny config with 8 KDA and 8 MLA heads, so it splits over 8 ranks (1 head and 1 routed expert
    each)."""
    text = json.loads(json.dumps(hf.get("text_config", hf)))
    text["linear_attn_config"]["num_heads"] = 8
    text["num_attention_heads"] = 8
    return {**hf, "text_config": text} if "text_config" in hf else text


@pytest.mark.parametrize("world", [4, 8])
def test_tp4_and_tp8_equal_tp1(tmp_path, world: int):
    """Kimi Linear and K3 split over 4 and 8 gloo ranks on the CPU (issue 23's CPU part): heads, the dense
    MLP, shared experts and lm_head sharded, routed experts split as expert parallelism (at 8 ranks one
    expert each). Gathered logits are identical on every rank and equal TP=1 up to fp32 summation order."""
    dirs = [str(write_checkpoint(tmp_path / name, _wide(hf), seed)) for seed, (name, hf) in
            enumerate({"kimi_linear": KIMI_LINEAR, "k3": K3}.items())]  # fmt: skip
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(world))
    ranks = spawn_gloo(_tp_logits, world, dirs, ids)
    for i, d in enumerate(dirs):
        ref = load_model(d).logits(ids)
        assert all(torch.equal(ranks[0][i], r[i]) for r in ranks[1:])
        assert_close(f"{Path(d).name} TP={world} vs TP=1", ref, ranks[0][i], rtol=1e-5)


def test_two_torchrun_nodes_of_two_ranks(tmp_path):
    """`torchrun --nnodes 2 --node-rank R --nproc-per-node 2` launched twice on one host (static rendezvous,
    gloo): the 4 ranks split the wide Kimi Linear over 4; global rank 0 prints what one process prints, the
    others print nothing, and both launchers and their four ranks exit cleanly within the timeout, the
    shutdown barrier included (issue 23's multi-node path, on the CPU)."""
    _two_torchrun_nodes(tmp_path, 2, "cpu")


@pytest.mark.gpu
def test_two_torchrun_nodes_nccl(tmp_path):
    """The same on the GPUs of one host over NCCL: two "nodes" of half the GPUs each (4 + 4 on eight; the
    wide model splits over 4 or 8 ranks)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n not in (4, 8):
        pytest.skip(f"needs 4 or 8 GPUs, found {n}")
    _two_torchrun_nodes(tmp_path, n // 2, "cuda")


def _two_torchrun_nodes(tmp_path, nproc: int, device: str) -> None:
    import os
    import subprocess
    import sys

    from tests.engine.conftest import CHARS, write_char_tokenizer
    from tests.tp_utils import free_port

    d = write_checkpoint(tmp_path / "wide", _wide(KIMI_LINEAR), 5)
    write_char_tokenizer(d, CHARS[: VOCAB - 2])  # ids 0..95: the model's vocabulary
    gen = ["-m", "k3run.cli", "generate", str(d), "--prompt", "def f(x):", "--max-tokens", "8"]
    gen += ["--temperature", "0", "--device", device, "--dtype", "fp32", "--quiet"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["K3RUN_DIST_BACKEND"] = "gloo"
    single = subprocess.run([sys.executable, *gen], env=env, capture_output=True, text=True, timeout=180)
    assert single.returncode == 0, single.stderr[-2000:]
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
              "--master-addr", "127.0.0.1", "--master-port", port]  # fmt: skip
    # each "node" sees its own GPUs, as two hosts would (local ranks 0.. on both)
    own = [",".join(str(r * nproc + i) for i in range(nproc)) for r in range(2)]
    gpus = [{} if device == "cpu" else {"CUDA_VISIBLE_DEVICES": own[r]} for r in range(2)]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(r), *gen],
            env=env | gpus[r],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    assert outs[0][0] == single.stdout and single.stdout.startswith("def f(x):")
    assert outs[1][0] == ""
