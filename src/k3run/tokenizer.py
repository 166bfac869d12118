"""Tokenizers for checkpoint directories: HF `tokenizer.json`, or Kimi's tiktoken `tiktoken.model`.

Both expose the same small surface (`encode`, `decode`, `eos_token_ids`, `apply_chat_template`). The chat
template and the special-token names come from tokenizer_config.json when the directory has one.
"""

from __future__ import annotations

import base64
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Kimi's pre-tokenisation pattern (tokenization_kimi.py): Han runs, then words split at case changes,
# 1-3 digit groups, punctuation runs, newlines and whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256


class TokenizerError(ValueError):
    """The directory has no usable tokenizer, or its files are inconsistent."""


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as {"content": ..., ...}
    if tok is None:
        return None
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    raise TokenizerError(f"special token entry {tok!r} is neither a string nor an object with 'content'")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer(ABC):
    def __init__(self, tokenizer_config: dict[str, Any], extra_eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer_config = tokenizer_config
        self.chat_template = self._find_chat_template(tokenizer_config)
        self.bos_token = _token_content(tokenizer_config.get("bos_token"))
        self.eos_token = _token_content(tokenizer_config.get("eos_token"))
        eos: set[int] = set(int(i) for i in extra_eos_ids)
        if self.eos_token is not None:
            tid = self.token_to_id(self.eos_token)
            if tid is None:
                raise TokenizerError(
                    f"eos_token {self.eos_token!r} from tokenizer_config.json is not in the vocab"
                )
            eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @staticmethod
    def _find_chat_template(cfg: dict[str, Any]) -> str | None:
        tpl = cfg.get("chat_template")
        if tpl is None or isinstance(tpl, str):
            return tpl
        # list form: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            if "default" in named:
                return named["default"]
        raise TokenizerError(
            "tokenizer_config.json chat_template is neither a string nor a list with 'default'"
        )

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abstractmethod
    def token_to_id(self, token: str) -> int | None: ...

    def llguidance_tokenizer(self, n_vocab: int) -> Any:
        """This tokenizer as an llguidance LLTokenizer over n_vocab ids (the model's logits width), for
        constrained decoding (engine/grammar.py)."""
        raise TokenizerError(f"{type(self).__name__} does not support constrained decoding")

    def encode_text(self, text: str) -> list[int]:
        """text as ordinary text: special-token strings written in it are spelled, never the special token
        (what a renderer uses for content a user or tool wrote)."""
        raise TokenizerError(f"{type(self).__name__} cannot encode text without special tokens")

    def xgrammar_tokenizer_info(self, n_vocab: int, special_text: bool = False) -> Any:
        """This tokenizer as an xgrammar TokenizerInfo over n_vocab ids (engine/grammar.py); special_text:
        special tokens read as their text (for structures that name markers by token)."""
        raise TokenizerError(f"{type(self).__name__} does not support constrained decoding")

    def _eos_list(self) -> list[int]:
        eos = sorted(self.eos_token_ids)
        if not eos:
            raise TokenizerError(
                "constrained decoding needs an end-of-sequence token, and this tokenizer has none"
            )
        return eos

    @property
    def eos_token_id(self) -> int | None:
        if self.eos_token is not None:
            return self.token_to_id(self.eos_token)
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat_template in tokenizer_config.json")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed to render: {e}") from e


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` loaded with the `tokenizers` library."""

    xgrammar_specials_as_text = True  # its xgrammar vocabulary always reads special tokens as their text

    def __init__(
        self, path: Path, tokenizer_config: dict[str, Any], extra_eos_ids: Sequence[int] = ()
    ) -> None:
        from tokenizers import Tokenizer as _HFTok

        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses for malformed files
            raise TokenizerError(f"{path}: cannot load tokenizer.json ({e})") from e
        self._plain_lock = threading.Lock()  # encode_text flips the tokenizer's special-token mode
        super().__init__(tokenizer_config, extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        with self._plain_lock:
            self._tok.encode_special_tokens = True
            try:
                return list(self._tok.encode(text, add_special_tokens=False).ids)
            finally:
                self._tok.encode_special_tokens = False

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def llguidance_tokenizer(self, n_vocab: int) -> Any:
        import llguidance

        return llguidance.LLTokenizer(self._tok.to_str(), n_vocab=n_vocab, eos_token=self._eos_list())

    def xgrammar_tokenizer_info(self, n_vocab: int, special_text: bool = False) -> Any:
        import transformers
        import xgrammar as xgr

        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tok)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=n_vocab, stop_token_ids=self._eos_list())


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file: one `base64(token_bytes) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:60]!r}")
            try:
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except ValueError as e:
                raise TokenizerError(f"{path}:{lineno}: {e}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} with no gaps or repeats")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """Kimi's tokenizer: BPE ranks from `tiktoken.model`, Kimi's split pattern, special tokens after the BPE
    vocabulary (named by tokenizer_config.json's added_tokens_decoder, the rest reserved)."""

    def __init__(
        self, path: Path, tokenizer_config: dict[str, Any], extra_eos_ids: Sequence[int] = ()
    ) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise TokenizerError(
                f"{path.parent} has a tiktoken tokenizer (tiktoken.model) but the 'tiktoken' package is not "
                f"installed; pip install tiktoken"
            ) from e
        ranks = load_tiktoken_ranks(path)
        n_base = len(ranks)
        named: dict[int, str] = {}
        for tid, entry in tokenizer_config.get("added_tokens_decoder", {}).items():
            named[int(tid)] = _token_content(entry) or ""
        n_special = max(KIMI_NUM_RESERVED_SPECIAL_TOKENS, max(named, default=-1) + 1 - n_base)
        special: dict[str, int] = {}
        for tid in range(n_base, n_base + n_special):
            special[named.get(tid, f"<|reserved_token_{tid}|>")] = tid
        for tid in named:
            if tid < n_base:
                raise TokenizerError(
                    f"added token id {tid} ({named[tid]!r}) collides with the BPE vocabulary"
                )
        self._special = special
        self._special_ids = frozenset(special.values())
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "kimi",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        self._n_base = n_base
        super().__init__(tokenizer_config, extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._n_base + len(self._special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # special tokens written in the text are recognised (as Kimi's chat templates produce them)
        ids = self._enc.encode(text, allowed_special="all")
        if add_special_tokens and self.bos_token is not None and self.tokenizer_config.get("add_bos_token"):
            bos = self.token_to_id(self.bos_token)
            if bos is not None:
                ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode(list(ids), errors="replace")

    def encode_text(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def xgrammar_tokenizer_info(self, n_vocab: int, special_text: bool = False) -> Any:
        import xgrammar as xgr

        # raw bytes per id; special tokens (and ids past the vocabulary) as empty tokens, which xgrammar never
        # matches as text (unless special_text); the end-of-sequence ids are the stop tokens
        vocab = [b""] * n_vocab
        for piece, tid in self._enc._mergeable_ranks.items():
            if tid < n_vocab:
                vocab[tid] = piece
        if special_text:
            for name, tid in self._special.items():
                if tid < n_vocab:
                    vocab[tid] = name.encode("utf-8")
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=n_vocab, stop_token_ids=self._eos_list()
        )

    def llguidance_tokenizer(self, n_vocab: int) -> Any:
        import llguidance

        return llguidance.LLTokenizer.from_tiktoken(
            encoder=self._enc._mergeable_ranks, special_tokens=self._special, pattern=KIMI_PAT_STR,
            eos_token=self._eos_list(), n_vocab=n_vocab,
        )  # fmt: skip

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        try:
            return self._enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory: tokenizer.json if present, else tiktoken.model.

    Extra eos ids come from config.json / generation_config.json `eos_token_id` (int or list).
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise TokenizerError(f"{d}: not a directory")
    cfg_path = d / "tokenizer_config.json"
    tok_cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    if tok_cfg.get("chat_template") is None and (d / "chat_template.jinja").is_file():
        tok_cfg = {**tok_cfg, "chat_template": (d / "chat_template.jinja").read_text(encoding="utf-8")}
    eos_ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = d / name
        if p.is_file():
            v = _read_json(p).get("eos_token_id")
            if isinstance(v, int):
                eos_ids.append(v)
            elif isinstance(v, list):
                eos_ids.extend(int(x) for x in v)
    if (d / "tokenizer.json").is_file():
        return HFTokenizer(d / "tokenizer.json", tok_cfg, eos_ids)
    if (d / "tiktoken.model").is_file():
        return TiktokenTokenizer(d / "tiktoken.model", tok_cfg, eos_ids)
    raise TokenizerError(f"{d}: no tokenizer found (expected tokenizer.json or tiktoken.model)")
