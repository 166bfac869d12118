"""The bundled default model (assets/): consistent, k3-mixed as promised, and actually trained.

These tests read the committed assets; a missing or corrupted asset fails them (nothing is skipped).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from k3run.config import ModelConfig
from k3run.formats import dequantize_fp8_block, dequantize_nvfp4
from k3run.models.kimi import KimiForCausalLM
from k3run.safetensors_io import CheckpointReader
from k3run.testing import assert_close, rel_rms_error

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BF16_DIR = ASSETS / "default-model-bf16"
QUANT_DIR = ASSETS / "default-model-k3-mixed"
HELDOUT = ASSETS / "heldout.txt"
ASSETS_BUDGET_BYTES = 12_000_000  # issue 5: the bundled model is at most 12 MB

ROOT = "language_model.model."
KDA_FP8 = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_a_proj", "f_b_proj", "o_proj")
MLA_FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")


def _config() -> ModelConfig:
    return ModelConfig.from_hf(json.loads((BF16_DIR / "config.json").read_text()))


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(d) as reader:
        return {name: reader.get(name) for name in reader.tensors}


@pytest.fixture(scope="module")
def bf16_tensors() -> dict[str, torch.Tensor]:
    return _tensors(BF16_DIR)


@pytest.fixture(scope="module")
def quant_tensors() -> dict[str, torch.Tensor]:
    return _tensors(QUANT_DIR)


@pytest.fixture(scope="module")
def models() -> tuple[KimiForCausalLM, KimiForCausalLM]:
    """(bf16 original, k3-mixed quantized), loaded as `k3run` loads them."""
    from k3run.api import load_model

    return load_model(BF16_DIR), load_model(QUANT_DIR)


def test_assets_fit_the_budget() -> None:
    files = [p for p in ASSETS.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert {BF16_DIR / "model.safetensors", QUANT_DIR / "model.safetensors", HELDOUT} <= set(files)
    assert total <= ASSETS_BUDGET_BYTES, f"assets/ holds {total} bytes, budget {ASSETS_BUDGET_BYTES}"


def test_config_is_the_k3_architecture() -> None:
    cfg = _config()
    assert cfg.is_k3 and cfg.hidden_act == "situ"
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i)]
    mla = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    # MLA at every fourth layer and the last, KDA elsewhere (0-indexed)
    n = cfg.num_hidden_layers
    assert mla == [i for i in range(n) if (i + 1) % 4 == 0 or i + 1 == n]
    assert kda and len(mla) >= 2
    assert cfg.use_full_rank_gate and cfg.gate_lower_bound == -5.0
    assert cfg.q_lora_rank is not None and cfg.mla_use_output_gate
    assert cfg.routed_expert_hidden_size is not None and cfg.routed_expert_hidden_size < cfg.hidden_size
    assert cfg.latent_moe_use_norm and cfg.num_shared_experts >= 1
    assert cfg.layer_is_moe[0] is False and all(cfg.layer_is_moe[1:])
    # AttnRes: at least two blocks close (at layers 0, S, 2S, ...)
    assert cfg.attn_res_block_size is not None
    assert len(range(0, cfg.num_hidden_layers, cfg.attn_res_block_size)) >= 2
    # the quantized copy describes the same model
    qcfg = json.loads((QUANT_DIR / "config.json").read_text())
    assert ModelConfig.from_hf(qcfg) == cfg


def test_bf16_checkpoint_tensors_match_the_config(bf16_tensors: dict[str, torch.Tensor]) -> None:
    cfg = _config()
    D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    fp32_names = ("A_log", "dt_bias", "e_score_correction_bias")
    for name, t in bf16_tensors.items():
        want = torch.float32 if name.endswith(fp32_names) else torch.bfloat16
        assert t.dtype == want, f"{name}: {t.dtype}, expected {want}"
        assert bool(torch.isfinite(t.float()).all()), f"{name}: non-finite values"
    for i in range(cfg.num_hidden_layers):
        a = f"{ROOT}layers.{i}.self_attn."
        if cfg.is_kda_layer(i):
            assert bf16_tensors[a + "q_proj.weight"].shape == (H * K, D)
            assert bf16_tensors[a + "b_proj.weight"].shape == (H, D)
            assert bf16_tensors[a + "f_a_proj.weight"].shape == (K, D)
            assert bf16_tensors[a + "q_conv1d.weight"].shape == (H * K, 1, cfg.conv_kernel_size)
            assert bf16_tensors[a + "A_log"].shape == (H,)
        else:
            kv_a = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)
            assert bf16_tensors[a + "kv_a_proj_with_mqa.weight"].shape == kv_a
            assert bf16_tensors[a + "q_a_proj.weight"].shape == (cfg.q_lora_rank, D)
    # trained, not initial: the AttnRes pseudo-queries start at zero and the norms at one
    moved = [n for n in bf16_tensors if n.endswith("_res_proj.weight") and bf16_tensors[n].abs().max() > 0]
    assert len(moved) >= cfg.num_hidden_layers


def test_bf16_model_loads(models: tuple[KimiForCausalLM, KimiForCausalLM]) -> None:
    bf16, quant = models
    assert bf16.config == quant.config == _config()


def test_quantized_checkpoint_is_k3_mixed(quant_tensors: dict[str, torch.Tensor]) -> None:
    cfg = _config()
    hq = json.loads((QUANT_DIR / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt"
    q = hq["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    layers = q["quantized_layers"]
    ragged = []
    for i in range(cfg.num_hidden_layers):
        a = f"{ROOT}layers.{i}.self_attn."
        for proj in KDA_FP8 if cfg.is_kda_layer(i) else MLA_FP8:
            assert layers[a + proj]["quant_algo"] == "FP8_PB_WO", a + proj
            w, s = quant_tensors[a + proj + ".weight"], quant_tensors[a + proj + ".weight_scale"]
            n, k = w.shape
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert k % 128 == 0, f"{a + proj}: FP8_PB_WO needs K % 128 == 0, got {k}"
            tiles = (math.ceil(n / 128), 1, k // 128, 1)
            # ModelOpt writes a single-tile layer's scale as a 0-dim tensor
            assert s.shape == tiles or (s.dim() == 0 and math.prod(tiles) == 1), (a + proj, s.shape)
            if n % 128:
                ragged.append(a + proj)
        if cfg.is_moe_layer(i):
            m = f"{ROOT}layers.{i}.block_sparse_moe."
            for e in range(cfg.num_experts or 0):
                for w_name in ("w1", "w2", "w3"):
                    base = f"{m}experts.{e}.{w_name}"
                    assert layers[base]["quant_algo"] == "NVFP4", base
                    w = quant_tensors[base + ".weight"]
                    k = w.shape[1] * 2
                    assert w.dtype == torch.uint8
                    assert quant_tensors[base + ".weight_scale"].dtype == torch.float8_e4m3fn
                    assert quant_tensors[base + ".weight_scale"].shape == (w.shape[0], k // 16)
                    assert quant_tensors[base + ".weight_scale_2"].numel() == 1
            # kept in bf16, as in nvidia/Kimi-K3-NVFP4
            for kept in ("gate.weight", "routed_expert_down_proj.weight", "shared_experts.down_proj.weight"):
                assert quant_tensors[m + kept].dtype == torch.bfloat16, m + kept
    assert quant_tensors["language_model.lm_head.weight"].dtype == torch.bfloat16
    # the padded-output FP8 path is exercised (kv_a_proj_with_mqa = kv_lora + rope, b_proj = H)
    assert any(name.endswith("kv_a_proj_with_mqa") for name in ragged), ragged
    assert any(name.endswith("b_proj") for name in ragged), ragged


def test_quantized_weights_are_the_bf16_weights(
    bf16_tensors: dict[str, torch.Tensor], quant_tensors: dict[str, torch.Tensor]
) -> None:
    cfg = _config()
    mla = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    name = f"{ROOT}layers.{mla}.self_attn.kv_a_proj_with_mqa"
    deq = dequantize_fp8_block(quant_tensors[name + ".weight"], quant_tensors[name + ".weight_scale"])
    # e4m3 keeps 3 mantissa bits: one rounding is <= 2^-4 relative for normal values; RMS well below that
    assert_close(name, bf16_tensors[name + ".weight"].float(), deq, rtol=2**-4)
    base = f"{ROOT}layers.1.block_sparse_moe.experts.0.w1"
    w, w_scale, w_scale_2 = (quant_tensors[base + s] for s in (".weight", ".weight_scale", ".weight_scale_2"))
    deq = dequantize_nvfp4(w, w_scale, w_scale_2)
    ref = bf16_tensors[base + ".weight"].float()
    # e2m1 has one mantissa bit (values 0, 0.5, 1, 1.5, 2, 3, 4, 6): a half step is up to 1/6 of the block
    # max, so the RMS error of Gaussian-like weights is a few tenths at most, and far from 1 (unrelated data)
    err = rel_rms_error(ref, deq)
    assert err < 0.25, f"{base}: NVFP4 relative RMS error {err:.3f}"


def _heldout_windows(tokenizer_dir: Path, n_windows: int, window: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(HELDOUT.read_text(encoding="utf-8")).ids
    assert len(ids) >= n_windows * window, f"{HELDOUT}: only {len(ids)} tokens"
    return [ids[i * window : (i + 1) * window] for i in range(n_windows)]


def _nll(model: KimiForCausalLM, windows: list[list[int]]) -> float:
    total, count = 0.0, 0
    for w in windows:
        ids = torch.tensor(w, dtype=torch.int64)
        logits = model.logits(ids[:-1])
        total += float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
        count += len(w) - 1
    return total / count


def test_heldout_perplexity_beats_unigram_and_survives_quantization(
    models: tuple[KimiForCausalLM, KimiForCausalLM],
) -> None:
    bf16, quant = models
    windows = _heldout_windows(QUANT_DIR, n_windows=8, window=256)
    # The best any unigram model can do on this very text: its own token frequencies (an optimistic baseline).
    counts = Counter(t for w in windows for t in w[1:])
    n = sum(counts.values())
    unigram_ppl = math.exp(-sum(c / n * math.log(c / n) for c in counts.values()))
    ppl_bf16 = math.exp(_nll(bf16, windows))
    ppl_quant = math.exp(_nll(quant, windows))
    # measured when the assets were made: bf16 ppl 37.4 against 244 for this text's own unigram distribution
    # (36.1 before the chat fine-tune), so the bar unigram / 5 (48.8) leaves a 30% margin. The 150-step H200
    # checkpoint (ppl 59.8) fails it, and an untrained model scores about 2000 (uniform over the vocabulary).
    assert ppl_bf16 < unigram_ppl / 5, f"bf16 ppl {ppl_bf16:.1f} vs unigram {unigram_ppl:.1f}"
    # issue 5: the quantized default model is within 5% of its bf16 original on held-out text
    assert abs(ppl_quant / ppl_bf16 - 1) < 0.05, f"k3-mixed ppl {ppl_quant:.2f} vs bf16 {ppl_bf16:.2f}"


def test_generation_looks_like_python(models: tuple[KimiForCausalLM, KimiForCausalLM]) -> None:
    from tokenizers import Tokenizer

    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.forward_context import ForwardContext
    from k3run.tokenizer import load_tokenizer

    _, model = models
    tok = Tokenizer.from_file(str(QUANT_DIR / "tokenizer.json"))
    # The README's sample prompt. Greedy decoding of a model this small loops: since the chat fine-tune the
    # greedy continuation of "def " is a comment line repeated (`# the currently received by the ...`), and
    # for "def fibonacci(n):\n" it writes `def _get_reader(self, name, name, name, ...` (assets/README.md).
    # Greedy output must still not collapse onto a few tokens; the Python shape is checked on a seeded
    # sample at temperature 0.7 (the README's sampled example), which reads the whole distribution.
    prompt = tok.encode("def ").ids
    new_tokens = 48
    cache = model.make_cache(num_slots=1, max_len=len(prompt) + new_tokens)
    ids, out = torch.tensor(prompt, dtype=torch.int64), []
    with torch.inference_mode():
        for _ in range(new_tokens):
            done = len(prompt) + len(out) - ids.numel()
            ctx = ForwardContext(
                cu_seqlens=torch.tensor([0, ids.numel()]),
                context_lens=torch.tensor([done]),
                slots=torch.tensor([0]),
                cache=cache,
            )
            nxt = int(model.compute_logits(model(ids, ctx))[-1].argmax())
            out.append(nxt)
            ids = torch.tensor([nxt])
    text = tok.decode(out)
    counts = Counter(out)
    assert len(counts) >= 12, f"degenerate greedy output ({len(counts)} distinct tokens): {text!r}"
    assert counts.most_common(1)[0][1] <= new_tokens // 3, f"one token dominates: {text!r}"
    llm = LLM.from_model(model, load_tokenizer(QUANT_DIR), EngineConfig(max_num_seqs=1, max_model_len=128))
    sample = llm.generate(["def "], SamplingParams(max_tokens=new_tokens, temperature=0.7, seed=0))[0].text
    assert "\n" in sample and any(k in sample for k in ("return", "if ", "for ", "=")), sample
    assert "\n    " in sample, f"no indented block: {sample!r}"


def _train_script():  # noqa: ANN202 - a module loaded from scripts/, which is not a package
    import importlib.util

    path = ASSETS.parent / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_init_from_restores_the_bundled_weights_exactly(bf16_tensors: dict[str, torch.Tensor]) -> None:
    """`train --init-from` starts from the checkpoint's weights: bf16 -> fp32 master -> bf16 is lossless."""
    script = _train_script()
    config = json.loads((BF16_DIR / "config.json").read_text())
    model = script.build_model(config, "cpu")
    script.init_weights(model, config, torch.Generator().manual_seed(123))
    script.load_init_checkpoint(model, config, BF16_DIR)
    state = script.export_state(model, config, script.probe_checkpoint_map(config))
    assert set(state) == set(bf16_tensors)
    for name, t in bf16_tensors.items():
        assert state[name].dtype == t.dtype, name
        assert torch.equal(state[name], t), f"{name}: not restored bit-exactly"


def test_init_from_rejects_a_different_config(tmp_path: Path) -> None:
    script = _train_script()
    config = json.loads((BF16_DIR / "config.json").read_text())
    other = json.loads(json.dumps(config))
    other["text_config"]["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(other))
    model = script.build_model(config, "cpu")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        script.load_init_checkpoint(model, config, tmp_path)


# ---------------------------------------------------------------- chat: template, tokens, stopping, loss

CHAT_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
BPE_VOCAB = 2048  # the byte-level BPE the model was pre-trained with; the chat tokens come after it


def test_chat_tokens_are_special_tokens_after_the_bpe_vocabulary() -> None:
    from k3run.tokenizer import load_tokenizer

    for d in (BF16_DIR, QUANT_DIR):
        tok = load_tokenizer(d)
        vocab = ModelConfig.from_hf(json.loads((d / "config.json").read_text())).vocab_size
        # padded with reserved tokens to a multiple of 8, so the vocab-parallel lm_head splits evenly
        assert tok.vocab_size == vocab == 2056, d
        ids = [tok.token_to_id(t) for t in CHAT_TOKENS]
        assert ids == list(range(BPE_VOCAB, BPE_VOCAB + len(CHAT_TOKENS))), ids
        # <|im_end|> ends a chat turn, <|endoftext|> a completion
        assert tok.eos_token_ids == {tok.token_to_id("<|endoftext|>"), ids[-1]}, d
        header = tok.encode("<|im_user|>user<|im_middle|>", add_special_tokens=False)
        assert header == [ids[1], tok.token_to_id("user"), ids[3]]
        assert tok.decode(header) == "user"  # the markers are special: skipped when decoding
    # plain text never produces a chat or reserved id: the pre-trained encoding is unchanged
    assert max(load_tokenizer(QUANT_DIR).encode(HELDOUT.read_text(encoding="utf-8"))) < BPE_VOCAB


def test_chat_template_renders_kimi_role_sections() -> None:
    from k3run.tokenizer import TokenizerError, load_tokenizer

    tok = load_tokenizer(QUANT_DIR)
    assert tok.chat_template == load_tokenizer(BF16_DIR).chat_template == _train_script().CHAT_TEMPLATE
    system = {"role": "system", "content": "Answer briefly."}
    user = {"role": "user", "content": "What does `json.dumps` do?"}
    answer = {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."}
    follow_up = {"role": "user", "content": "And `json.loads`?\n"}
    assert tok.apply_chat_template([user]) == (
        "<|im_user|>user<|im_middle|>What does `json.dumps` do?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert tok.apply_chat_template([system, user]) == (
        "<|im_system|>system<|im_middle|>Answer briefly.<|im_end|>"
        "<|im_user|>user<|im_middle|>What does `json.dumps` do?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    # multi-turn, no generation prompt; content is written as given (the trailing newline stays)
    assert tok.apply_chat_template([system, user, answer, follow_up], add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Answer briefly.<|im_end|>"
        "<|im_user|>user<|im_middle|>What does `json.dumps` do?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Serialize ``obj`` to a JSON formatted ``str``.<|im_end|>"
        "<|im_user|>user<|im_middle|>And `json.loads`?\n<|im_end|>"
    )
    # a tool result is a system-kind section named "tool", as in Kimi's template
    assert tok.apply_chat_template([{"role": "tool", "content": "42"}], add_generation_prompt=False) == (
        "<|im_system|>tool<|im_middle|>42<|im_end|>"
    )
    with pytest.raises(TokenizerError, match="unknown role narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_chat_training_masks_follow_the_template() -> None:
    """The fine-tune's loss mask: assistant content and its <|im_end|>, in the template's own tokens."""
    from tokenizers import Tokenizer

    from k3run.tokenizer import load_tokenizer

    script = _train_script()
    raw, tok = Tokenizer.from_file(str(QUANT_DIR / "tokenizer.json")), load_tokenizer(QUANT_DIR)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does `abs` do?"},
        {"role": "assistant", "content": "Absolute value."},
        {"role": "user", "content": "Show it."},
        {"role": "assistant", "content": "```python\nabs(-1)\n```"},
    ]
    ids, mask = script.encode_conversation(raw, msgs)
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    trained = raw.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert trained == "Absolute value.<|im_end|>```python\nabs(-1)\n```<|im_end|>"


def test_init_from_grows_a_pre_chat_vocabulary(tmp_path: Path, bf16_tensors: dict[str, torch.Tensor]) -> None:
    """`train --chat-data --init-from <pre-chat checkpoint>`: old rows kept exactly, new ones by the mean."""
    from safetensors.torch import save_file

    script = _train_script()
    config = json.loads((BF16_DIR / "config.json").read_text())
    old = json.loads(json.dumps(config))
    old["text_config"]["vocab_size"] = BPE_VOCAB
    small = {n: t[:BPE_VOCAB] if n in script.VOCAB_ROWS else t for n, t in bf16_tensors.items()}
    save_file(small, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(old))
    model = script.build_model(config, "cpu")
    script.init_weights(model, config, torch.Generator().manual_seed(5))
    script.load_init_checkpoint(model, config, tmp_path, torch.Generator().manual_seed(0))
    state = script.export_state(model, config, script.probe_checkpoint_map(config))
    for name, t in bf16_tensors.items():
        if name not in script.VOCAB_ROWS:
            assert torch.equal(state[name], t), name
            continue
        assert torch.equal(state[name][:BPE_VOCAB], t[:BPE_VOCAB]), name
        w, new = t[:BPE_VOCAB].float(), state[name][BPE_VOCAB:].float()
        spread = float((w - w.mean(0)).pow(2).mean().sqrt())
        deviation = float((new - w.mean(0)).pow(2).mean().sqrt())
        assert 0.05 * spread < deviation < 0.2 * spread, (name, deviation, spread)  # 0.1 x spread, drawn
    # a smaller vocabulary is accepted only with the rest of the config equal
    old["text_config"]["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        script.load_init_checkpoint(model, config, tmp_path)


# Held-out chat turns (from stdlib files the model never saw, in the fine-tune's own question forms): a user
# question and the answer the chat corpus gives for it (the docstring's first paragraph, or the signature).
HELDOUT_CHATS = (
    ("What does `distutils.util.change_root` do?", "Return 'pathname' with 'new_root' prepended."),
    ("What is `random.Random.expovariate` for?", "Exponential distribution."),
    ("What does `pydoc.TextDoc.docdata` do?", "Produce text documentation for a data descriptor."),
    ("What is the signature of `chunk.Chunk.skip`?", "`skip(self)`"),
    (
        "What does `ast.NodeVisitor.generic_visit` do?",
        "Called if no explicit visitor function exists for a node.",
    ),
    (
        "Explain `distutils.util.strtobool`.",
        "Convert a string representation of truth to true (1) or false (0).",
    ),
    (
        "Explain `http.server.BaseHTTPRequestHandler.send_header`.",
        "Send a MIME header to the headers buffer.",
    ),
    ("What is `pydoc.render_doc` for?", "Render text documentation, given an object or a path to an object."),
    ("Explain `lib2to3.main.diff_texts`.", "Return a unified diff of two strings."),
)


def test_heldout_chat_answers_are_learned(models: tuple[KimiForCausalLM, KimiForCausalLM]) -> None:
    from tokenizers import Tokenizer

    script = _train_script()
    _, quant = models
    tok = Tokenizer.from_file(str(QUANT_DIR / "tokenizer.json"))
    total, count = 0.0, 0
    for ask, answer in HELDOUT_CHATS:
        msgs = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        ids, mask = script.encode_conversation(tok, msgs)
        ids_t, keep = torch.tensor(ids), torch.tensor(mask[1:], dtype=torch.bool)
        nll = torch.nn.functional.cross_entropy(quant.logits(ids_t[:-1]), ids_t[1:], reduction="none")
        total, count = total + float(nll[keep].sum()), count + int(keep.sum())
    # the 130 answer tokens with their <|im_end|>s: 3.72 nats per token for the shipped model (bf16 and
    # k3-mixed alike); the pre-chat model with its vocabulary grown, where the fine-tune started, scores 5.34
    assert total / count < 4.5, f"held-out chat answers: {total / count:.3f} nats/token"


def test_chat_answers_stop_at_im_end(models: tuple[KimiForCausalLM, KimiForCausalLM]) -> None:
    """Greedy chat turns on the shipped model end with <|im_end|> (an eos), and no other chat marker is
    generated, so none can leak into the assistant's text. Answers that are code can still loop greedily
    until the token limit: "Write a function that returns the square of a number." does (assets/README.md)."""
    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.engine.sequence import FinishReason
    from k3run.tokenizer import load_tokenizer

    _, quant = models
    tok = load_tokenizer(QUANT_DIR)
    llm = LLM.from_model(quant, tok, EngineConfig(max_num_seqs=8, max_model_len=256))
    markers = {tok.token_to_id(t) for t in CHAT_TOKENS}
    im_end = tok.token_to_id("<|im_end|>")
    chats = [
        [{"role": "user", "content": "What does `json.dumps` do?"}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}],
        [{"role": "user", "content": "What arguments does `os.path.join` take?"}],
        [{"role": "user", "content": "Show me the source of `os.path.basename`."}],
        [
            {"role": "user", "content": "What does `json.dumps` do?"},
            {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."},
            {"role": "user", "content": "What arguments does `json.dumps` take?"},
        ],
    ]
    prompts = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in chats]
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0))
    for msgs, out in zip(chats, outs, strict=True):
        assert out.finish_reason == FinishReason.STOP and out.token_ids[-1] == im_end, (msgs, out.text)
        assert not markers & set(out.token_ids[:-1]), (msgs, out.token_ids)
        assert out.text.strip() and "<|" not in out.text, (msgs, out.text)


@pytest.mark.parametrize("name", ["default-model-bf16", "default-model-k3-mixed"])
def test_bundled_configs_nest_the_k3_gate_fields_as_the_published_config_does(name: str) -> None:
    """moonshotai/Kimi-K3's config.json nests `gate_lower_bound` and `use_full_rank_gate` in
    `linear_attn_config`, and llama.cpp's and SGLang's K3 converters read them only there. Written at the top
    level (as the bundled configs were), llama.cpp ran its Kimi Linear softplus decay in every KDA layer: the
    K3 mismatch of issue 24 (switching k3run's decay the same way moves the bundled model's logits by 9-21%
    and top-1 to 69-86%, bench/NOTES.md session 18). k3run reads the nested fields as before."""
    from k3run.cli import ASSETS_DIR

    hf = json.loads((ASSETS_DIR / name / "config.json").read_text())
    text = hf.get("text_config", hf)
    lac = text["linear_attn_config"]
    assert lac["gate_lower_bound"] == -5.0 and lac["use_full_rank_gate"] is True
    assert "gate_lower_bound" not in text and "use_full_rank_gate" not in text
    cfg = ModelConfig.from_hf(hf)
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate
