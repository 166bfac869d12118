"""A tiny stand-in with the real model's interface and cache semantics, for engine tests that must not
depend on the full Kimi model: one KDA-like layer (causal conv over q|k|v with the conv cache, a decayed
outer-product state in the recurrent cache) and one MLA-like layer (softmax attention over latents stored
in the slot's latent cache). A wrong slot, context length or offset changes its logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from k3run.config import ModelConfig
from k3run.engine import LLM, EngineConfig
from k3run.forward_context import ForwardContext, KDALayerCache, MLALayerCache
from k3run.tokenizer import Tokenizer, load_tokenizer

TOY_HF_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": 128,
    "hidden_size": 24,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "intermediate_size": 32,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 4,
        "short_conv_kernel_size": 4,
        "kda_layers": [1],
        "full_attn_layers": [2],
    },
    "num_attention_heads": 2,
    "kv_lora_rank": 6,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
}


class ToyModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.config = ModelConfig.from_hf(TOY_HF_CONFIG)
        c = self.config
        g = torch.Generator().manual_seed(seed)
        D, V = c.hidden_size, c.vocab_size
        self.H, self.K = c.kda_num_heads, c.kda_head_dim
        P = self.H * self.K
        self.W = c.conv_kernel_size
        lat = c.kv_lora_rank + c.qk_rope_head_dim

        def p(*shape: int, scale: float = 1.0) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embed = p(V, D)
        self.qkv = p(3 * P, D, scale=D**-0.5)
        self.conv_w = p(3 * P, self.W, scale=0.5)
        self.kda_out = p(D, P, scale=P**-0.5)
        self.lat_proj = p(lat, D, scale=D**-0.5)
        self.q_proj = p(lat, D, scale=D**-0.5)
        self.mla_out = p(D, lat, scale=lat**-0.5)
        self.lm_head = p(V, D, scale=3 * D**-0.5)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed[input_ids]  # [T, D]
        outs = []
        kda, mla = ctx.cache.layers if ctx.cache is not None else (None, None)
        for b, (n, start) in enumerate(zip(ctx.seqlens_list, ctx.context_lens_list)):
            lo = int(ctx.cu_seqlens[b])
            h = x[lo : lo + n]  # [n, D]
            slot = int(ctx.slots[b]) if ctx.slots is not None else None
            h = h + self._kda(h, kda, slot, start)
            h = h + self._mla(h, mla, slot, start)
            outs.append(h)
        return torch.cat(outs)

    def _kda(
        self, h: torch.Tensor, cache: KDALayerCache | None, slot: int | None, start: int
    ) -> torch.Tensor:
        pre = h @ self.qkv.T  # [n, 3P]
        if cache is not None and start > 0:
            hist = cache.conv[slot].T  # [W-1, 3P]
        else:
            hist = pre.new_zeros(self.W - 1, pre.shape[1])
        seq = torch.cat([hist, pre])  # [W-1+n, 3P]
        conv = torch.stack([(seq[t : t + self.W] * self.conv_w.T).sum(0) for t in range(pre.shape[0])])
        q, k, v = torch.nn.functional.silu(conv).view(-1, 3, self.H, self.K).unbind(1)  # [n, H, K]
        S = (
            cache.recurrent[slot].clone()
            if cache is not None and start > 0
            else h.new_zeros(self.H, self.K, self.K)
        )
        o = []
        for t in range(q.shape[0]):
            S = 0.9 * S + torch.einsum("hk,hv->hkv", k[t], v[t])
            o.append(torch.einsum("hkv,hk->hv", S, q[t]))
        if cache is not None:
            cache.conv[slot] = seq[-(self.W - 1) :].T
            cache.recurrent[slot] = S
        return torch.stack(o).reshape(q.shape[0], -1) @ self.kda_out.T

    def _mla(
        self, h: torch.Tensor, cache: MLALayerCache | None, slot: int | None, start: int
    ) -> torch.Tensor:
        n = h.shape[0]
        lat = h @ self.lat_proj.T  # [n, L+R]
        if cache is not None:
            cache.latent[slot, start : start + n] = lat
            keys = cache.latent[slot, : start + n]
        else:
            keys = lat
        scores = (h @ self.q_proj.T) @ keys.T  # [n, start+n]
        pos = torch.arange(start, start + n).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(keys.shape[0]).unsqueeze(0) > pos, float("-inf"))
        return scores.softmax(-1) @ keys @ self.mla_out.T

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.forward(input_ids, ForwardContext.single(input_ids.numel())))


CHARS = ["\n", *(chr(c) for c in range(32, 127))]


def write_char_tokenizer(d: Path, chars: list[str] = CHARS) -> None:
    """A character-level tokenizer.json (ids: <eos> 0, <unk> 1, then `chars`: newline and printable ASCII)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>", "<unk>"])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("chartok")
    write_char_tokenizer(d)
    return load_tokenizer(d)


@pytest.fixture(params=[None, True], ids=["sync", "overlap"])
def toy_llm(char_tokenizer: Tokenizer, request: pytest.FixtureRequest):
    """An LLM over the toy model; every test runs twice: plain steps (overlap_decode None is off on the CPU)
    and with decode overlap forced on (each decode step launched before the previous one is recorded)."""

    def make(**kw) -> LLM:
        cfg = EngineConfig(
            **{"max_num_seqs": 8, "max_model_len": 96, "max_num_batched_tokens": 256,
               "overlap_decode": request.param, **kw}
        )  # fmt: skip
        return LLM.from_model(ToyModel(), char_tokenizer, cfg)

    return make
