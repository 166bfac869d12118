"""Tokenizer loading: HF tokenizer.json, Kimi's tiktoken.model, chat templates, eos ids, errors."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from k3run.tokenizer import HFTokenizer, TiktokenTokenizer, TokenizerError, load_tokenizer

TEXT = "def add(a, b):\n    return a + b  # naïve sum, 日本語 ok\n\tHelloWorld 12345!"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)


def _write_bpe(d: Path, tokenizer_config: dict | None = None, **files: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT * 3, "return the value of a and b"] * 20, trainer)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in files.items():
        (d / f"{name}.json").write_text(json.dumps(content))


def test_hf_round_trip_eos_and_chat_template(tmp_path: Path) -> None:
    _write_bpe(
        tmp_path,
        {"eos_token": {"content": "<|im_end|>"}, "chat_template": CHAT_TEMPLATE},
        generation_config={"eos_token_id": [0, 1]},
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.decode(ids) == TEXT
    assert tok.eos_token_id == 1 and tok.eos_token_ids == {0, 1}
    msgs = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == "<|im_user|>hi<|im_end|><|im_assistant|>"
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_user|>") and ids[-1] == tok.token_to_id("<|im_assistant|>")
    assert tok.decode(ids) == "hi"  # special tokens skipped
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_chat_template_list_form_and_jinja_file(tmp_path: Path) -> None:
    _write_bpe(
        tmp_path / "a", {"chat_template": [{"name": "default", "template": "{{ messages[0].content }}!"}]}
    )
    assert load_tokenizer(tmp_path / "a").apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    _write_bpe(tmp_path / "b", {})
    (tmp_path / "b" / "chat_template.jinja").write_text("[{{ messages | length }}]")
    assert load_tokenizer(tmp_path / "b").apply_chat_template([{"role": "user", "content": "x"}] * 2) == "[2]"
    _write_bpe(tmp_path / "c", None)
    with pytest.raises(TokenizerError, match="no chat_template"):
        load_tokenizer(tmp_path / "c").apply_chat_template([])


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer found"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")
    _write_bpe(tmp_path / "d", {"eos_token": "<|missing|>"})
    with pytest.raises(TokenizerError, match="eos_token '<|missing|>'"):
        load_tokenizer(tmp_path / "d")


def _write_tiktoken(d: Path) -> int:
    """A tiny tiktoken.model: the 256 bytes, then merges that build a few words. Returns the BPE size."""
    merges = [
        b"he",
        b"ll",
        b"hell",
        b"hello",
        b"Wo",
        b"rl",
        b"Worl",
        b"World",
        b"oW",
        b"lo",
        b"Hel",
        b"Hello",
    ]
    merges += ["日本".encode(), "日本語".encode()]
    tokens = [bytes([i]) for i in range(256)] + merges
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(tokens)
    config = {
        "eos_token": "[EOS]",
        "bos_token": "[BOS]",
        "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"}},
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return n


def test_tiktoken_round_trip_special_tokens_and_kimi_split(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    n_base = _write_tiktoken(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == n_base + 256  # named + reserved special tokens
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    hello, world = tok.token_to_id("Hello"), tok.token_to_id("World")
    # Kimi's pattern splits at the case change, so the 'oW' merge can never apply across it
    assert tok.encode("HelloWorld") == [hello, world]
    assert tok.encode("日本語") == [tok.token_to_id("日本語")]
    assert tok.eos_token_ids == {n_base + 1} and tok.token_to_id("[BOS]") == n_base
    assert tok.token_to_id(f"<|reserved_token_{n_base + 7}|>") == n_base + 7
    ids = tok.encode("[BOS]hello[EOS]")
    assert ids == [n_base, tok.token_to_id("hello"), n_base + 1]
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "[BOS]hello[EOS]"


def test_tiktoken_missing_package_and_bad_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_tiktoken(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
    with pytest.raises(TokenizerError, match="pip install tiktoken"):
        load_tokenizer(tmp_path)
    monkeypatch.undo()
    pytest.importorskip("tiktoken")
    (tmp_path / "tiktoken.model").write_text("aGk= 0\naGk= 1\n")
    with pytest.raises(TokenizerError, match="ranks must be 0..0"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_text("not-a-pair\n")
    with pytest.raises(TokenizerError, match="expected 'base64-token rank'"):
        load_tokenizer(tmp_path)
