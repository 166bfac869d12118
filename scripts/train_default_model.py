"""Train k3run's bundled default model: a tiny Kimi K3 on the Python standard library sources.

Four steps, each deterministic given its arguments and seed:

  prepare       collect the stdlib .py files of the running interpreter (sorted, filtered), split them into
                train and held-out files by a hash of their relative path, train a byte-level BPE tokenizer on
                the train files and write the token streams (uint16) plus a manifest with the corpus sha256.
  prepare-chat  the chat tokenizer (the BPE plus Kimi's role markers <|im_system|> <|im_user|>
                <|im_assistant|> <|im_middle|> <|im_end|> as special tokens, padded with reserved ones), its
                chat template and eos ids, and chat streams: synthetic conversations about the same stdlib
                files (what a function does, its arguments, its code), with a mask of the assistant tokens.
  train         build k3run's own KimiForCausalLM (unquantized, fp32 master weights) from the bundled config,
                train it with AdamW on random windows of the train stream, print the loss, and save a bf16
                checkpoint in the original Kimi K3 naming (config.json, model.safetensors, tokenizer.json).
  eval          held-out perplexity of checkpoint directories, next to the uniform and unigram baselines
                (with --chat-data also the held-out chat loss).

`train --init-from DIR` continues from a bf16 checkpoint of the same config written by this script: the
weights are restored exactly, the AdamW moments start at zero (the checkpoint holds none), so give it a short
--warmup; the LR then decays by cosine to --final-lr-frac. The run is deterministic given --seed and --procs.
`train --chat-data DIR` adds --chat-batch chat windows to each step's --batch language-model windows (the
chat loss counts assistant tokens only) and saves the chat tokenizer files; with --init-from a pre-chat
checkpoint its vocabulary is grown by the new rows (grow_vocab).

Example (the commands that produced assets/ are in assets/README.md):
  python scripts/train_default_model.py prepare --out out/default_model
  python scripts/train_default_model.py train --device cuda --out out/default_model/bf16  (options: README)
  python scripts/train_default_model.py train --init-from out/default_model/bf16 --out ...  (continuation)
  python scripts/train_default_model.py prepare-chat --data out/default_model --out out/default_model/chat
  python scripts/train_default_model.py train --chat-data out/default_model/chat --init-from ... --out ...
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from k3run.forward_context import ForwardContext
    from k3run.models.kimi import KimiForCausalLM

EOS_TOKEN = "<|endoftext|>"
# Directories left out of the corpus: third-party code, the test suite (deliberately odd encodings and binary
# literals), generated codec tables and the pydoc topic dump (prose, not code).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings", "pydoc_data"}
)
HELDOUT_BUCKETS = 20  # one file in twenty (by path hash) is held out for evaluation


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """The split depends on the relative path only: the same on every interpreter that has the file."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return digest[0] % HELDOUT_BUCKETS == 0


def corpus_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib .py file kept in the corpus, in sorted path order."""
    root = root or stdlib_root()
    out: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((rel.as_posix(), text.replace("\r\n", "\n")))
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Documents joined as `EOS doc EOS doc ...`: a window starting after an EOS sees a file start."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eos_id)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


def cmd_prepare(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files()
    train = [(p, t) for p, t in files if not is_heldout(p)]
    heldout = [(p, t) for p, t in files if is_heldout(p)]
    corpus_sha = hashlib.sha256()
    for p, t in files:
        corpus_sha.update(p.encode() + b"\0" + t.encode() + b"\0")
    t0 = time.perf_counter()
    tok = train_tokenizer([t for _, t in train], args.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    tok.save(str(out / "tokenizer.json"))
    train_ids = encode_stream(tok, [t for _, t in train], eos_id)
    val_ids = encode_stream(tok, [t for _, t in heldout], eos_id)
    train_ids.tofile(out / "train.u16")
    val_ids.tofile(out / "val.u16")
    train_bytes = sum(len(t.encode()) for _, t in train)
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "heldout_rule": f"sha256(relpath)[0] % {HELDOUT_BUCKETS} == 0",
        "corpus_sha256": corpus_sha.hexdigest(),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos_id,
        "train_files": len(train),
        "heldout_files": [p for p, _ in heldout],
        "train_bytes": train_bytes,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "bytes_per_token": train_bytes / max(1, train_ids.size - len(train)),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"python {manifest['python']}: {len(files)} files, {len(train)} train / {len(heldout)} held out, "
        f"{train_bytes / 1e6:.2f} MB train text, {train_ids.size} train tokens, "
        f"{val_ids.size} held-out tokens, "
        f"{manifest['bytes_per_token']:.2f} bytes/token, tokenizer in {time.perf_counter() - t0:.1f}s"
    )
    print(f"corpus sha256 {manifest['corpus_sha256']}")


# ---------------------------------------------------------------- chat data: prepare-chat, train --chat-data

# Kimi's role markers, added after the BPE vocabulary as special tokens, so a turn header is three tokens
# (`<|im_user|>` `user` `<|im_middle|>`). Reserved tokens pad the vocabulary to a multiple of
# CHAT_VOCAB_MULTIPLE: the vocab-parallel lm_head splits the vocabulary evenly over the tensor-parallel ranks.
CHAT_SPECIAL_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
IM_END = "<|im_end|>"
CHAT_VOCAB_MULTIPLE = 8
# Kimi K2 / K3's layout: each message is `<|im_{kind}|>{role}<|im_middle|>{content}<|im_end|>` with nothing
# between messages, and the generation prompt opens an assistant section. Tool results are a system-kind
# section named "tool", as in Kimi's template. Unlike Kimi's, no default system prompt is inserted.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool"
    "{%- else -%}{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# The same headers in Python, for the token-level masks; prepare-chat checks every conversation against the
# template rendered by k3run's tokenizer.
CHAT_HEADERS = {
    "system": "<|im_system|>system<|im_middle|>",
    "user": "<|im_user|>user<|im_middle|>",
    "assistant": "<|im_assistant|>assistant<|im_middle|>",
}
CHAT_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a Python expert. Answer briefly.",
    "You answer questions about the Python standard library.",
    "You are k3run's default model.",
)
CHAT_SMALL_TALK = (
    ("Hello", "Hello! Ask me what a Python standard library function does, or ask me to write one."),
    ("Hi!", "Hi! Ask me about a function of the Python standard library."),
    (
        "Who are you?",
        "I am k3run's bundled default model, a tiny Kimi K3 trained on the Python standard library.",
    ),
    (
        "What can you do?",
        "I can say what a standard library function does, show its arguments, and write Python code.",
    ),
    ("Thanks!", "You're welcome."),
)
CHAT_MAX_SUMMARY_CHARS = 200
CHAT_MAX_SOURCE_LINES = 16
CHAT_MAX_SOURCE_CHARS = 640
CHAT_MAX_TOKENS = 256  # a conversation fits one training window


class CodeEntry(NamedTuple):
    """One public function, method or class of a stdlib module, as the chat corpus asks about it."""

    qualname: str  # json.dumps, json.decoder.JSONDecoder.decode
    name: str  # dumps
    signature: str | None  # dumps(obj, *, skipkeys=False, ...); a class's from __init__; none for properties
    summary: str | None  # the docstring's first paragraph on one line, when short enough
    source: str | None  # the dedented definition with its decorators, when short enough


def module_name(relpath: str) -> str:
    parts = relpath.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def docstring_summary(node: ast.AST) -> str | None:
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    if not doc:
        return None
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if len(text) > CHAT_MAX_SUMMARY_CHARS:
        cut = text.find(". ")
        text = text[: cut + 1] if 0 < cut < CHAT_MAX_SUMMARY_CHARS else ""
    # C-style first lines (`name(args) -> result`) and doctests are not a description
    if not text or "->" in text.split(" ", 1)[0] or text.startswith((">>>", getattr(node, "name", "") + "(")):
        return None
    return text


def code_entries(relpath: str, text: str) -> list[CodeEntry]:
    """Public module-level functions and classes, and public methods of public classes, in source order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    module = module_name(relpath)
    out: list[CodeEntry] = []

    def entry(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, prefix: str) -> CodeEntry:
        signature = None
        if isinstance(node, ast.ClassDef):  # called as its __init__ is, without self
            init = [c for c in node.body if isinstance(c, ast.FunctionDef) and c.name == "__init__"]
            if init:
                args = ast.unparse(init[0].args).split(", ", 1)
                signature = f"{node.name}({args[1] if len(args) > 1 else ''})"
        elif not any("property" in ast.unparse(d) or "setter" in ast.unparse(d) for d in node.decorator_list):
            signature = f"{node.name}({ast.unparse(node.args)})"
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = lines[first - 1 : node.end_lineno]
        source = textwrap.dedent("\n".join(body)).rstrip()
        if len(body) > CHAT_MAX_SOURCE_LINES or len(source) > CHAT_MAX_SOURCE_CHARS:
            source = None
        summary = docstring_summary(node)
        return CodeEntry(f"{module}.{prefix}{node.name}", node.name, signature, summary, source)

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, (*functions, ast.ClassDef)) and not node.name.startswith("_"):
            out.append(entry(node, ""))
            if isinstance(node, ast.ClassDef):
                methods = [c for c in node.body if isinstance(c, functions) and not c.name.startswith("_")]
                out += [entry(m, node.name + ".") for m in methods]
    return out


def chat_exchanges(e: CodeEntry, rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs about one entry: what it does, its arguments, its code."""
    q = f"`{e.qualname}`"
    code = f"```python\n{e.source}\n```" if e.source else None
    out = []
    if e.summary:
        # the last phrasing lacks its question mark, as questions are often typed
        ask = rng.choice((f"What does {q} do?", f"What is {q} for?", f"Explain {q}.", f"What does {q} do"))
        out.append((ask, e.summary))
    if e.signature and rng.random() < 0.5:
        ask = rng.choice((f"What arguments does {q} take?", f"What is the signature of {q}?"))
        out.append((ask, f"`{e.signature}`"))
    if code and e.summary and rng.random() < 0.6:
        ask = rng.choice(
            (
                f"Write a function `{e.name}`: {e.summary}",
                f"Write a Python function that does this: {e.summary}",
                f"Implement `{e.name}`. {e.summary}",
            )
        )
        out.append((ask, code))
    elif code:
        ask = rng.choice((f"Show me the source of {q}.", f"How is {q} implemented?"))
        out.append((ask, code))
    return out


def chat_conversations(files: list[tuple[str, str]], seed: int, small_talk: bool) -> list[list[dict]]:
    """Deterministic conversations about the given files: single exchanges, and multi-turn ones chaining two
    or three exchanges of one module; half of them with a system prompt; shuffled."""
    rng = random.Random(seed)
    convs: list[list[dict]] = []
    for relpath, text in files:
        pairs = [p for e in code_entries(relpath, text) for p in chat_exchanges(e, rng)]
        i = 0
        while i < len(pairs):
            turns = 1 if rng.random() < 0.7 else rng.choice((2, 3))
            msgs = []
            if rng.random() < 0.5:
                msgs.append({"role": "system", "content": rng.choice(CHAT_SYSTEM_PROMPTS)})
            for ask, answer in pairs[i : i + turns]:
                msgs += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
            convs.append(msgs)
            i += turns
    if small_talk:  # a fixed handful, about one conversation in a hundred
        for k in range(max(1, len(convs) // 100)):
            ask, answer = CHAT_SMALL_TALK[k % len(CHAT_SMALL_TALK)]
            msgs = [{"role": "system", "content": rng.choice(CHAT_SYSTEM_PROMPTS)}] if k % 2 else []
            convs.append(msgs + [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}])
    rng.shuffle(convs)
    return convs


def encode_conversation(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask marking the tokens the model is trained to write:
    each assistant message's content and its <|im_end|>."""
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        head = tok.encode(CHAT_HEADERS[m["role"]]).ids
        body = tok.encode(m["content"] + IM_END).ids
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def chat_tokenizer(base: Tokenizer) -> Tokenizer:
    """The base tokenizer plus the chat tokens and reserved ones (Kimi's `<|reserved_token_ID|>` names) after
    the BPE vocabulary. Plain text encodes exactly as before: special tokens only match their literal text."""
    from tokenizers import Tokenizer as _Tok

    tok = _Tok.from_str(base.to_str())
    n = tok.get_vocab_size(with_added_tokens=True)
    total = -(-(n + len(CHAT_SPECIAL_TOKENS)) // CHAT_VOCAB_MULTIPLE) * CHAT_VOCAB_MULTIPLE
    reserved = [f"<|reserved_token_{i}|>" for i in range(n + len(CHAT_SPECIAL_TOKENS), total)]
    tok.add_special_tokens([*CHAT_SPECIAL_TOKENS, *reserved])
    ids = [tok.token_to_id(t) for t in (*CHAT_SPECIAL_TOKENS, *reserved)]
    if ids != list(range(n, total)) or tok.get_vocab_size(with_added_tokens=True) != total:
        raise ValueError(f"chat tokens did not get the ids {n}..{total - 1}: {ids}")
    return tok


def encode_chat_stream(tok: Tokenizer, convs: list[list[dict]], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Conversations joined as `conv EOS conv EOS ...` (a conversation starts at token 0 or after an EOS, as a
    chat prompt starts the context) and the loss mask; conversations over CHAT_MAX_TOKENS are dropped."""
    ids: list[int] = []
    mask: list[int] = []
    for msgs in convs:
        c_ids, c_mask = encode_conversation(tok, msgs)
        if len(c_ids) > CHAT_MAX_TOKENS:
            continue
        ids += c_ids + [eos_id]
        mask += c_mask + [0]
    return np.asarray(ids, dtype=np.uint16), np.asarray(mask, dtype=np.uint8)


def cmd_prepare_chat(args: argparse.Namespace) -> None:
    """The chat tokenizer (tokenizer.json, tokenizer_config.json with the template, generation_config.json)
    and the chat streams, from the output of `prepare`."""
    from tokenizers import Tokenizer as _Tok

    from k3run.tokenizer import load_tokenizer

    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((data / "manifest.json").read_text())
    base = _Tok.from_file(str(data / "tokenizer.json"))
    tok = chat_tokenizer(base)
    eos_id = tok.token_to_id(EOS_TOKEN)
    im_end = tok.token_to_id(IM_END)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "eos_token": EOS_TOKEN,
        "bos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "eos_token_id": eos_id,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    # <|im_end|> ends an assistant turn, <|endoftext|> a completion: the engine stops on either
    gen_cfg = {"bos_token_id": eos_id, "eos_token_id": [eos_id, im_end], "pad_token_id": eos_id}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    files = corpus_files(Path(manifest["stdlib"]))
    train = [(p, t) for p, t in files if not is_heldout(p)]
    heldout = [(p, t) for p, t in files if is_heldout(p)]
    for _, t in heldout:  # the LM streams stay valid under the chat tokenizer
        if tok.encode(t).ids != base.encode(t).ids:
            raise ValueError("the chat tokenizer encodes plain text differently from the base tokenizer")
    k3tok = load_tokenizer(out)
    streams = {}
    for split, part, seed in (("train", train, args.seed), ("val", heldout, args.seed + 1)):
        convs = chat_conversations(part, seed, small_talk=split == "train")
        for msgs in convs:  # the masks' headers are the template's, token for token
            rendered = k3tok.apply_chat_template(msgs, add_generation_prompt=False)
            if k3tok.encode(rendered, add_special_tokens=False) != encode_conversation(tok, msgs)[0]:
                raise ValueError(f"CHAT_HEADERS disagree with CHAT_TEMPLATE on {msgs!r}")
        ids, mask = encode_chat_stream(tok, convs, eos_id)
        ids.tofile(out / f"chat_{split}.u16")
        mask.tofile(out / f"chat_{split}_mask.u8")
        streams[split] = {
            "conversations": int((ids == eos_id).sum()),
            "dropped_over_max_tokens": len(convs) - int((ids == eos_id).sum()),
            "tokens": int(ids.size),
            "assistant_tokens": int(mask.sum()),
            "sha256": hashlib.sha256(ids.tobytes() + mask.tobytes()).hexdigest(),
            "example": k3tok.apply_chat_template(convs[0], add_generation_prompt=False),
        }
    chat_manifest = {
        "base_tokenizer_sha256": manifest["tokenizer_sha256"],
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_id": eos_id,
        "chat_token_ids": {t: tok.token_to_id(t) for t in CHAT_SPECIAL_TOKENS},
        "seed": args.seed,
        **streams,
    }
    (out / "chat_manifest.json").write_text(json.dumps(chat_manifest, indent=1) + "\n")
    for split in ("train", "val"):
        s = streams[split]
        print(
            f"{split}: {s['conversations']} conversations ({s['dropped_over_max_tokens']} over "
            f"{CHAT_MAX_TOKENS} tokens dropped), {s['tokens']} tokens, "
            f"{s['assistant_tokens']} assistant tokens, sha256 {s['sha256'][:16]}"
        )
    print(f"vocab {chat_manifest['vocab_size']}, chat tokens {chat_manifest['chat_token_ids']}")
    print(f"example:\n{streams['train']['example']}")


def load_chat_stream(data: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, conversation starts) of chat_{split}: a conversation starts at 0 and after each EOS."""
    ids = load_stream(data / f"chat_{split}.u16")
    mask = torch.from_numpy(np.fromfile(data / f"chat_{split}_mask.u8", dtype=np.uint8).astype(np.bool_))
    eos = json.loads((data / "chat_manifest.json").read_text())["eos_id"]
    ends = torch.nonzero(ids == eos).flatten()
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1] + 1])
    return ids, mask, starts


def sample_chat_batch(
    stream: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, batch: int, seq_len: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`batch` windows of seq_len + 1 tokens, each starting at a conversation start: inputs and targets, the
    targets that are not assistant tokens set to -100 (ignored by the loss)."""
    usable = starts[starts < stream.numel() - seq_len - 1]
    pick = usable[torch.randint(0, usable.numel(), (batch,), generator=gen)]
    idx = pick[:, None] + torch.arange(seq_len + 1)[None, :]
    win, keep = stream[idx], mask[idx]
    targets = win[:, 1:].masked_fill(~keep[:, 1:], -100)
    return win[:, :-1], targets


def chat_nll(
    model: KimiForCausalLM, chat: tuple[torch.Tensor, torch.Tensor, torch.Tensor], max_convs: int, device: str
) -> tuple[float, int, int]:
    """Mean NLL (nats) of the assistant tokens (content and <|im_end|>) of the first `max_convs` held-out
    conversations, each run alone from a fresh context as a chat request is. (nll, tokens, conversations)."""
    ids, mask, starts = chat
    total, count = 0.0, 0
    bounds = torch.cat([starts, ids.new_tensor([ids.numel()])])
    n = min(max_convs, starts.numel())
    with torch.no_grad():
        for c in range(n):
            s, e = int(bounds[c]), int(bounds[c + 1]) - 1  # without the EOS separator
            conv, keep = ids[s:e].to(device), mask[s + 1 : e].to(device)
            logits = model.logits(conv[:-1])
            nll = torch.nn.functional.cross_entropy(logits, conv[1:], reduction="none")
            total += float(nll[keep].sum())
            count += int(keep.sum())
    return total / max(1, count), count, n


def model_config(vocab_size: int, eos_id: int) -> dict:
    """The bundled model's config.json in the original Kimi K3 form (a kimi_k3 wrapper around kimi_linear).

    Widths are chosen for the quantization constraints and the 12 MB asset budget:
    - every FP8_PB_WO projection has an input width that is a multiple of 128 (hidden 128, KDA P = 2*128,
      KDA head_dim 128 feeding f_b_proj, q_lora 128, kv_lora 128, MLA H*v_head_dim = 128);
    - several FP8_PB_WO outputs are not multiples of 128: kv_a_proj_with_mqa (kv_lora 128 + rope 64 = 192)
      and b_proj (H = 2), so the padded-output path is exercised;
    - NVFP4 experts: latent width 64 and moe_intermediate 64 are multiples of the 16-element block.
    MLA at every fourth layer and the last (1-indexed 4 and 8), as in K3; AttnRes blocks of 3 layers close
    at layers 0, 3 and 6, so the mixes see up to four candidates.
    """
    n_layers = 8
    full_attn = [4, 8]
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": n_layers,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 384,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, n_layers + 1) if i not in full_attn],
            "full_attn_layers": full_attn,
            "num_heads": 2,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            # where the published moonshotai/Kimi-K3 config has them (and the only place llama.cpp's and
            # SGLang's K3 converters read them; k3run reads either)
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "attn_res_block_size": 3,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 4096,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def checkpoint_layout(config: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor of the bf16 checkpoint in the original Kimi K3 naming: (name, shape, dtype).

    A_log, dt_bias and the router's e_score_correction_bias are fp32 in the released checkpoints; the rest is
    bf16. The list is the contract the loader checks against the model, so a missing or extra name fails the
    export's round trip.
    """
    c = config["text_config"]
    D, V = c["hidden_size"], c["vocab_size"]
    lin = c["linear_attn_config"]
    H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    P = H * K
    Hm, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kl = c["q_lora_rank"], c["kv_lora_rank"]
    E, lat, mi = c["num_experts"], c["routed_expert_hidden_size"], c["moe_intermediate_size"]
    shared = mi * c["num_shared_experts"]
    bf, f32 = torch.bfloat16, torch.float32
    root = "language_model.model."
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = [(root + "embed_tokens.weight", (V, D), bf)]
    for i in range(c["num_hidden_layers"]):
        pre = f"{root}layers.{i}."
        out += [(pre + n, (D,), bf) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        for site in ("self_attention_res", "mlp_res"):
            out += [(f"{pre}{site}_norm.weight", (D,), bf), (f"{pre}{site}_proj.weight", (1, D), bf)]
        a = pre + "self_attn."
        if (i + 1) in lin["kda_layers"]:
            out += [(a + f"{n}_proj.weight", (P, D), bf) for n in "qkvg"]
            out += [(a + f"{n}_conv1d.weight", (P, 1, W), bf) for n in "qkv"]
            out += [
                (a + "b_proj.weight", (H, D), bf),
                (a + "f_a_proj.weight", (K, D), bf),
                (a + "f_b_proj.weight", (P, K), bf),
                (a + "A_log", (H,), f32),
                (a + "dt_bias", (P,), f32),
                (a + "o_norm.weight", (K,), bf),
                (a + "o_proj.weight", (D, P), bf),
            ]
        else:
            out += [
                (a + "q_a_proj.weight", (ql, D), bf),
                (a + "q_a_layernorm.weight", (ql,), bf),
                (a + "q_b_proj.weight", (Hm * (dn + dr), ql), bf),
                (a + "kv_a_proj_with_mqa.weight", (kl + dr, D), bf),
                (a + "kv_a_layernorm.weight", (kl,), bf),
                (a + "kv_b_proj.weight", (Hm * (dn + dv), kl), bf),
                (a + "g_proj.weight", (Hm * dv, D), bf),
                (a + "o_proj.weight", (D, Hm * dv), bf),
            ]
        if i < c["first_k_dense_replace"]:
            I = c["intermediate_size"]  # noqa: E741 - the spec's name for the dense width
            out += [(pre + f"mlp.{n}_proj.weight", (I, D), bf) for n in ("gate", "up")]
            out += [(pre + "mlp.down_proj.weight", (D, I), bf)]
        else:
            m = pre + "block_sparse_moe."
            out += [(m + "gate.weight", (E, D), bf), (m + "gate.e_score_correction_bias", (E,), f32)]
            for e in range(E):
                out += [(m + f"experts.{e}.{w}.weight", (mi, lat), bf) for w in ("w1", "w3")]
                out += [(m + f"experts.{e}.w2.weight", (lat, mi), bf)]
            out += [(m + f"shared_experts.{n}_proj.weight", (shared, D), bf) for n in ("gate", "up")]
            out += [
                (m + "shared_experts.down_proj.weight", (D, shared), bf),
                (m + "routed_expert_down_proj.weight", (lat, D), bf),
                (m + "routed_expert_up_proj.weight", (D, lat), bf),
                (m + "routed_expert_norm.weight", (lat,), bf),
            ]
    out += [
        (root + "norm.weight", (D,), bf),
        (root + "output_attn_res_norm.weight", (D,), bf),
        (root + "output_attn_res_proj.weight", (1, D), bf),
        ("language_model.lm_head.weight", (V, D), bf),
    ]
    return out


def build_model(config: dict, device: str | torch.device) -> KimiForCausalLM:
    """k3run's own KimiForCausalLM, unquantized with fp32 parameters (the training master weights)."""
    from k3run.config import ModelConfig
    from k3run.models.kimi import KimiForCausalLM

    with torch.device(device):
        return KimiForCausalLM(ModelConfig.from_hf(config), params_dtype=torch.float32)


def probe_checkpoint_map(config: dict) -> dict[str, torch.Tensor]:
    """Where each checkpoint element lands in the model: per parameter, the 1-based global element id.

    Writes a checkpoint whose elements are their own global ids (exact in fp32 below 2^24) and loads it with
    k3run's loader through the model's checkpoint-name table. Reading the parameters back inverts every
    fusion (in_proj, gate_up, conv, w13) without this script knowing how the model fuses anything.
    """
    from safetensors.torch import save_file

    from k3run.loader import load_checkpoint

    layout = checkpoint_layout(config)
    total = sum(math.prod(s) for _, s, _ in layout)
    if total >= 2**24:
        raise ValueError(f"probe: {total} elements do not have exact fp32 ids")
    tensors, base = {}, 1
    for name, shape, _ in layout:
        n = math.prod(shape)
        tensors[name] = torch.arange(base, base + n, dtype=torch.float32).reshape(shape)
        base += n
    probe = build_model(config, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        load_checkpoint(probe, Path(tmp) / "model.safetensors", probe.checkpoint_mapping, progress=False)
    return {n: p.detach().round().long() for n, p in probe.named_parameters()}


def export_state(
    model: torch.nn.Module, config: dict, probe: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's weights as the original-naming checkpoint tensors (dtypes of checkpoint_layout)."""
    layout = checkpoint_layout(config)
    total = sum(math.prod(s) for _, s, _ in layout)
    flat = torch.full((total + 1,), float("nan"), dtype=torch.float32)
    for name, p in model.named_parameters():
        ids = probe[name]
        if ids.shape != p.shape:
            raise ValueError(f"export: parameter {name} is {tuple(p.shape)}, the probe {tuple(ids.shape)}")
        flat[ids.flatten()] = p.detach().float().cpu().flatten()
    out, base = {}, 1
    for name, shape, dtype in layout:
        n = math.prod(shape)
        t = flat[base : base + n]
        if torch.isnan(t).any():
            raise ValueError(f"export: checkpoint tensor {name} is not fully covered by model parameters")
        out[name] = t.reshape(shape).to(dtype).contiguous()
        base += n
    return out


# Projections whose output is added to the residual stream (module names of k3run's parameters).
_RESIDUAL_OUTPUTS = frozenset({"o_proj", "down_proj", "routed_expert_up_proj"})


def init_weights(model: torch.nn.Module, config: dict, gen: torch.Generator) -> None:
    """Initialise the (empty or NaN-filled) parameters; the loader-oriented modules leave them unset.

    Matrices ~ N(0, 0.02), residual-branch outputs scaled by 1/sqrt(2 * layers) (GPT-2 style); norms 1;
    AttnRes pseudo-queries 0 (uniform mixing at the start, as in the AttnRes paper); KDA A_log and dt_bias as
    fla initialises them (A in [1, 16], dt in [1e-3, 0.1] through an inverse softplus); a small fixed random
    e_score_correction_bias so the routing bias path is exercised by the shipped model.
    """
    n_layers = config["text_config"]["num_hidden_layers"]
    out_std = 0.02 / math.sqrt(2 * n_layers)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif leaf == "dt_bias":
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "e_score_correction_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
            elif leaf == "proj_weight":
                p.zero_()
            elif leaf == "conv_weight":
                width = p.shape[-1]
                p.copy_(torch.empty(p.shape).uniform_(-(width**-0.5), width**-0.5, generator=gen))
            elif p.dim() == 1 or leaf == "norm_weight":
                p.fill_(1.0)
            else:
                module = name.rsplit(".", 2)[-2]
                writes_residual = module in _RESIDUAL_OUTPUTS or leaf == "w2_weight"
                std = out_std if writes_residual else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def load_stream(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))


def sample_batch(
    stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of seq_len + 1 tokens: inputs and next-token targets, each [batch, seq_len]."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    win = stream[idx]
    return win[:, :-1], win[:, 1:]


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    """Linear warm-up, then cosine decay to final_frac * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_context(batch: int, seq_len: int, device: torch.device | str) -> ForwardContext:
    """A ForwardContext of `batch` independent fresh sequences of seq_len tokens each (no cache)."""
    from k3run.forward_context import ForwardContext

    cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int64, device=device)
    return ForwardContext(cu_seqlens=cu, context_lens=torch.zeros(batch, dtype=torch.int64, device=device))


def heldout_nll(
    model: KimiForCausalLM, stream: torch.Tensor, seq_len: int, max_tokens: int, device: str
) -> tuple[float, int]:
    """Mean next-token NLL (nats) over consecutive held-out windows of seq_len + 1 tokens, each fresh."""
    total, count = 0.0, 0
    n_win = min((stream.numel() - 1) // seq_len, max(1, max_tokens // seq_len))
    with torch.no_grad():
        for w in range(n_win):
            win = stream[w * seq_len : (w + 1) * seq_len + 1].to(device)
            logits = model.logits(win[:-1])
            total += float(torch.nn.functional.cross_entropy(logits, win[1:], reduction="sum"))
            count += seq_len
    return total / count, count


def unigram_baseline(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy (nats) of the add-one-smoothed train unigram distribution."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val].mean())


@torch.no_grad()
def greedy(
    model: KimiForCausalLM, tok: Tokenizer, prompt: str, new_tokens: int, device: str, stop: int | None = None
) -> str:
    """The prompt and its greedy continuation; with `stop`, up to and including that token."""
    ids = tok.encode(prompt).ids
    for _ in range(new_tokens):
        logits = model.logits(torch.tensor(ids, dtype=torch.int64, device=device))
        ids.append(int(logits[-1].argmax()))
        if ids[-1] == stop:
            break
    return tok.decode(ids, skip_special_tokens=stop is None)


def save_checkpoint(
    out: Path,
    model: KimiForCausalLM,
    config: dict,
    probe: dict[str, torch.Tensor],
    data: Path,
    chat_data: Path | None = None,
) -> None:
    """The bf16 checkpoint; with `chat_data` its tokenizer files are prepare-chat's (template, eos list)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = export_state(model, config, probe)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if chat_data is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (out / name).write_bytes((chat_data / name).read_bytes())
        return
    (out / "tokenizer.json").write_bytes((data / "tokenizer.json").read_bytes())
    eos = json.loads((data / "manifest.json").read_text())["eos_id"]
    tok_cfg = {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "eos_token_id": eos}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, indent=2) + "\n"
    )


VOCAB_ROWS = ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight")


def grow_vocab(tensors: dict[str, torch.Tensor], vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The checkpoint with its embedding and lm_head grown to `vocab` rows. A new row is the mean of the
    existing rows plus N(0, (0.1 x their RMS deviation from it)^2) noise, so the new tokens start at the
    average embedding and an average logit, and differ from each other."""
    out = dict(tensors)
    for name in VOCAB_ROWS:
        w = tensors[name].float()
        mean = w.mean(0)
        spread = float((w - mean).pow(2).mean().sqrt())
        rows = mean + 0.1 * spread * torch.randn(vocab - w.shape[0], w.shape[1], generator=gen)
        out[name] = torch.cat([w, rows]).to(tensors[name].dtype)
    return out


def load_init_checkpoint(
    model: KimiForCausalLM, config: dict, src: Path, gen: torch.Generator | None = None
) -> None:
    """Overwrite the model's weights with a bf16 checkpoint written by this script for the same config.

    Only weights are restored: the checkpoint holds no optimizer state, so AdamW's moments start at zero
    and the caller's LR schedule (a short warm-up) has to absorb that. The bf16 values become the fp32
    master weights exactly (bf16 -> fp32 is lossless). A checkpoint whose config differs only by a smaller
    vocab_size (the pre-chat model under a chat tokenizer) is accepted: its rows are kept, and the new rows
    are drawn by grow_vocab from `gen`.
    """
    from safetensors.torch import load_file, save_file

    from k3run.loader import load_checkpoint
    from k3run.safetensors_io import read_checkpoint_headers

    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"--init-from {src}: no config.json")
    theirs = json.loads(cfg_path.read_text())
    vocab = config["text_config"]["vocab_size"]
    their_vocab = theirs.get("text_config", {}).get("vocab_size", vocab)
    grown = json.loads(json.dumps(theirs))
    if isinstance(their_vocab, int) and their_vocab < vocab:
        grown["text_config"]["vocab_size"] = vocab
    if grown == config and their_vocab != vocab:
        layout = {name for name, _, _ in checkpoint_layout(theirs)}
        if set(read_checkpoint_headers(src / "model.safetensors")) != layout:
            raise ValueError(f"--init-from {src}: its tensors do not match its config.json")
        tensors = grow_vocab(load_file(str(src / "model.safetensors")), vocab, gen or torch.Generator())
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            save_file(tensors, str(Path(tmp) / "model.safetensors"))
            load_checkpoint(model, Path(tmp) / "model.safetensors", model.checkpoint_mapping, progress=False)
        return
    if theirs != config:
        diff = sorted(
            k
            for k in set(theirs.get("text_config", {})) | set(config["text_config"])
            if theirs.get("text_config", {}).get(k) != config["text_config"].get(k)
        )
        raise ValueError(
            f"--init-from {src}: config.json differs from this script's model config "
            f"(text_config fields {diff or 'none; top-level fields differ'})"
        )
    layout = {name for name, _, _ in checkpoint_layout(config)}
    headers = read_checkpoint_headers(src / "model.safetensors")
    if set(headers) != set(layout):
        missing, extra = sorted(set(layout) - set(headers)), sorted(set(headers) - set(layout))
        raise ValueError(f"--init-from {src}: tensors missing {missing[:3]}..., unexpected {extra[:3]}...")
    with torch.no_grad():
        load_checkpoint(model, src / "model.safetensors", model.checkpoint_mapping, progress=False)


def cmd_train(args: argparse.Namespace) -> None:
    """Data-parallel over `--procs` processes (gloo all-reduce of the gradients; all may share one GPU).

    The reference KDA path launches many tiny kernels per 64-token chunk, so one process leaves a GPU mostly
    idle; several processes feeding the same GPU multiply the throughput. World size is part of the recipe:
    rank r draws its windows from generator seed*1000 + 1 + r, so the global batch is procs x batch.
    """
    if args.procs == 1:
        _train_worker(0, args, None)
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_train_worker, args=(args, f"file://{tmp}/rendezvous"), nprocs=args.procs, join=True)


CHAT_SAMPLE_PROMPTS = (
    [{"role": "user", "content": "What does `json.dumps` do?"}],  # a train-file function
    [{"role": "user", "content": "What does `random.shuffle` do?"}],  # random.py is held out
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a function that returns the square of a number."},
    ],
    [{"role": "user", "content": "Hello"}],
)


def _train_worker(rank: int, args: argparse.Namespace, init_method: str | None) -> None:
    import os

    import torch.distributed as dist
    from tokenizers import Tokenizer

    world = args.procs
    if init_method is not None:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    main_rank = rank == 0

    def say(msg: str) -> None:
        if main_rank:
            print(msg, flush=True)

    data, out = Path(args.data), Path(args.out)
    chat_data = Path(args.chat_data) if args.chat_data else None
    device = torch.device(args.device)
    if device.type == "cuda":
        # deterministic cuBLAS reductions; ops without a deterministic CUDA kernel only warn
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    manifest = json.loads((data / "manifest.json").read_text())
    train, val = load_stream(data / "train.u16"), load_stream(data / "val.u16")
    chat_train = chat_val = None
    if chat_data is not None:
        # the chat tokenizer extends the base one (plain text encodes the same), so the LM streams stay valid
        chat_manifest = json.loads((chat_data / "chat_manifest.json").read_text())
        if chat_manifest["base_tokenizer_sha256"] != manifest["tokenizer_sha256"]:
            raise ValueError(f"--chat-data {chat_data} was prepared from another tokenizer than {data}'s")
        tok = Tokenizer.from_file(str(chat_data / "tokenizer.json"))
        config = model_config(chat_manifest["vocab_size"], manifest["eos_id"])
        chat_train, chat_val = load_chat_stream(chat_data, "train"), load_chat_stream(chat_data, "val")
    else:
        tok = Tokenizer.from_file(str(data / "tokenizer.json"))
        config = model_config(manifest["vocab_size"], manifest["eos_id"])
    chat_batch = args.chat_batch if chat_data is not None else 0
    if chat_data is not None and chat_batch < 1:
        raise ValueError("--chat-data needs --chat-batch >= 1")

    torch.manual_seed(args.seed)
    probe = probe_checkpoint_map(config) if main_rank else {}
    # Built on the device directly: k3run's linear layers cannot be moved with Module.to() (their
    # LinearBase._apply(x, bias) shadows nn.Module._apply). init_weights draws on the CPU generator, so the
    # initial weights are the same on every device and every rank.
    model = build_model(config, device)
    init_weights(model, config, torch.Generator().manual_seed(args.seed))
    if args.init_from:
        # new vocabulary rows (a chat tokenizer over a pre-chat checkpoint) are drawn from their own seed
        load_init_checkpoint(model, config, Path(args.init_from), torch.Generator().manual_seed(args.seed))
        say(f"initialised from {args.init_from} (fresh optimizer state)")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            continue  # fixed selection bias (see init_weights); never trained by gradient
        p.requires_grad_(True)
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    trainable = decay + no_decay
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed * 1000 + 1 + rank)
    ctx = batch_context(args.batch + chat_batch, args.seq_len, device)
    uni = unigram_baseline(train, val, manifest["vocab_size"])
    tokens_per_step = world * (args.batch + chat_batch) * args.seq_len
    say(
        f"params {n_params}, train tokens {train.numel()}, "
        f"{world} procs x batch {args.batch} (+ {chat_batch} chat) x {args.seq_len} "
        f"= {tokens_per_step} tokens/step, max steps {args.steps}, device {device}, seed {args.seed}; "
        f"held-out baselines: uniform ppl {manifest['vocab_size']}, unigram ppl {math.exp(uni):.1f}"
    )
    log: dict = {"args": vars(args), "params": n_params, "unigram_nll": uni, "train": [], "heldout": []}
    prior_log = Path(args.init_from) / "train_log.json" if args.init_from else None
    if prior_log is not None and prior_log.is_file():
        # the continued checkpoint carries the whole history: the stage it started from, nested
        log["init_from_log"] = json.loads(prior_log.read_text())

    def evaluate(step: int) -> None:
        model.eval()
        nll, n = heldout_nll(model, val, args.seq_len, args.eval_tokens, str(device))
        entry = {"step": step, "nll": nll, "ppl": math.exp(nll), "tokens": n}
        msg = f"step {step:5d}  held-out nll {nll:.4f}  ppl {math.exp(nll):.2f}  ({n} tokens)"
        if chat_val is not None:
            c_nll, c_n, convs = chat_nll(model, chat_val, args.chat_eval_convs, str(device))
            entry |= {"chat_nll": c_nll, "chat_tokens": c_n, "chat_conversations": convs}
            msg += f"; held-out chat nll {c_nll:.4f} ({c_n} assistant tokens of {convs} conversations)"
        say(msg)
        log["heldout"].append(entry)

    if args.eval_at_start and main_rank:
        evaluate(0)
    total = args.steps
    t0, step = time.perf_counter(), 0
    run = torch.zeros(3, dtype=torch.float64)  # sums of the step losses: combined, LM windows, chat windows
    run_n = 0
    while step < total:
        lr = lr_at(step, total, args.lr, args.warmup, args.final_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sample_batch(train, args.batch, args.seq_len, gen)
        if chat_train is not None:
            xc, yc = sample_chat_batch(*chat_train, chat_batch, args.seq_len, gen)
            x, y = torch.cat([x, xc]), torch.cat([y, yc])
        model.train()
        hidden = model(x.flatten().to(device), ctx)
        logits = model.compute_logits(hidden)
        if not chat_batch:  # language modelling only: the loss of the earlier runs, computed as they did
            loss = torch.nn.functional.cross_entropy(logits, y.flatten().to(device))
            lm_loss, chat_loss = loss, torch.zeros((), device=device)
        else:
            per_token = torch.nn.functional.cross_entropy(
                logits, y.flatten().to(device), ignore_index=-100, reduction="none"
            ).view(args.batch + chat_batch, args.seq_len)
            # LM windows: every token; chat windows: the assistant tokens only. Each part's mean is weighted
            # by its share of the windows, so --batch 2 --chat-batch 2 is half language modelling, half chat.
            lm_loss = per_token[: args.batch].mean() if args.batch else per_token.new_zeros(())
            counted = (y[args.batch :] != -100).to(device)
            chat_loss = per_token[args.batch :][counted].sum() / counted.sum().clamp(min=1)
            loss = (args.batch * lm_loss + chat_batch * chat_loss) / (args.batch + chat_batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses = torch.stack([loss, lm_loss, chat_loss]).detach().cpu()
        if init_method is not None:
            for p in trainable:
                if p.grad is None:  # e.g. layer 0's self_attention_res: no closed block to mix yet
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.flatten() for p in trainable]).cpu()
            flat = torch.cat([flat, losses.to(flat.dtype)])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in trainable:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
            losses = flat[-3:]
        torch.nn.utils.clip_grad_norm_(trainable, args.clip)
        opt.step()
        run += losses.double()
        run_n += 1
        step += 1
        if step == args.budget_probe_steps and args.time_budget:
            # The step count is fixed here, inside the warm-up (whose lr does not depend on the total), so
            # this run is identical to one started with --steps <the printed count>.
            if args.warmup < args.budget_probe_steps:
                raise ValueError("--time-budget needs --budget-probe-steps <= --warmup")
            per_step = torch.tensor([(time.perf_counter() - t0) / step])
            if init_method is not None:
                dist.broadcast(per_step, 0)
            total = max(step, min(args.steps, int(args.time_budget / float(per_step))))
            log["args"]["steps"] = total
            say(f"{float(per_step):.3f} s/step: training for {total} steps (reproduce with --steps {total})")
        last = step == total
        if step % args.log_every == 0 or last:
            dt = time.perf_counter() - t0
            mean = (run / run_n).tolist()
            parts = f"  (lm {mean[1]:.4f}, chat {mean[2]:.4f})" if chat_batch else ""
            say(
                f"step {step:5d}  loss {mean[0]:.4f}{parts}  lr {lr:.2e}  "
                f"{step * tokens_per_step / dt:,.0f} tok/s"
            )
            entry = {"step": step, "loss": mean[0], "seconds": dt}
            if chat_batch:
                entry |= {"lm_loss": mean[1], "chat_loss": mean[2]}
            log["train"].append(entry)
            run.zero_()
            run_n = 0
        if step % args.eval_every == 0 or last:
            if main_rank:
                evaluate(step)
            if init_method is not None:
                dist.barrier()
    if main_rank:
        model.eval()
        for prompt in ("def fibonacci(n):\n", "import os\n\n\nclass ", "    for i in range("):
            text = greedy(model, tok, prompt, args.sample_tokens, str(device))
            say(f"--- greedy sample for {prompt!r}:\n{text}")
        if chat_data is not None:
            from k3run.tokenizer import load_tokenizer

            template, im_end = load_tokenizer(chat_data), tok.token_to_id(IM_END)
            for msgs in CHAT_SAMPLE_PROMPTS:
                prompt = template.apply_chat_template(msgs, add_generation_prompt=True)
                text = greedy(model, tok, prompt, args.sample_tokens, str(device), stop=im_end)
                say(f"--- greedy chat sample:\n{text}")
        if not args.no_save:
            save_checkpoint(out, model, config, probe, data, chat_data)
            (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
            say(f"saved {out}")
    if init_method is not None:
        dist.barrier()
        dist.destroy_process_group()


def cmd_eval(args: argparse.Namespace) -> None:
    from k3run.api import load_model

    data = Path(args.data)
    manifest = json.loads((data / "manifest.json").read_text())
    train, val = load_stream(data / "train.u16"), load_stream(data / "val.u16")
    uni = unigram_baseline(train, val, manifest["vocab_size"])
    print(f"uniform ppl {manifest['vocab_size']}  unigram ppl {math.exp(uni):.2f}")
    chat_val = load_chat_stream(Path(args.chat_data), "val") if args.chat_data else None
    for d in args.dirs:
        model = load_model(d, dtype=torch.float32 if args.fp32 else None, device=args.device)
        nll, n = heldout_nll(model, val, args.seq_len, args.tokens, args.device)
        print(
            f"{d}: held-out nll {nll:.4f}  ppl {math.exp(nll):.3f}  ({n} tokens, windows of {args.seq_len})"
        )
        if chat_val is None:
            continue
        if model.config.vocab_size <= int(chat_val[0].max()):
            print(f"{d}: vocab {model.config.vocab_size} has no chat tokens; chat loss not measured")
            continue
        c_nll, c_n, convs = chat_nll(model, chat_val, args.chat_convs, args.device)
        print(f"{d}: held-out chat nll {c_nll:.4f}  ({c_n} assistant tokens of {convs} conversations)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, split, tokenizer, token streams")
    p.add_argument("--out", default="out/default_model")
    p.add_argument("--vocab-size", type=int, default=2048)
    p = sub.add_parser("prepare-chat", help="chat tokenizer, template and chat streams (after prepare)")
    p.add_argument("--data", default="out/default_model", help="output directory of `prepare`")
    p.add_argument("--out", default="out/default_model/chat")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train", help="train and save the bf16 checkpoint")
    p.add_argument("--data", default="out/default_model")
    p.add_argument("--out", default="out/default_model/bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--final-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--sample-tokens", type=int, default=80)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--procs", type=int, default=1, help="data-parallel processes (may share one GPU)")
    p.add_argument("--time-budget", type=float, default=0, help="seconds; fixes --steps after the probe")
    p.add_argument("--budget-probe-steps", type=int, default=10)
    p.add_argument("--no-save", action="store_true", help="train and report only (timing runs)")
    p.add_argument(
        "--init-from",
        default="",
        help="bf16 checkpoint dir of the same config to continue from (weights only; AdamW starts fresh); "
        "with --chat-data it may have the smaller pre-chat vocabulary (new rows: grow_vocab)",
    )
    p.add_argument(
        "--chat-data",
        default="",
        help="prepare-chat's output: train on chat windows too (the chat tokenizer, template and eos ids are "
        "saved with the checkpoint)",
    )
    p.add_argument("--chat-batch", type=int, default=2, help="chat windows per step (with --chat-data)")
    p.add_argument("--chat-eval-convs", type=int, default=200, help="held-out conversations per eval")
    p.add_argument("--eval-at-start", action="store_true", help="evaluate before the first step too")
    p = sub.add_parser("eval", help="held-out perplexity of checkpoint directories")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--data", default="out/default_model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--fp32", action="store_true", help="run in fp32 instead of the checkpoint dtype")
    p.add_argument("--chat-data", default="", help="prepare-chat's output: also the held-out chat loss")
    p.add_argument("--chat-convs", type=int, default=200, help="held-out conversations for the chat loss")
    args = ap.parse_args(argv)
    commands = {
        "prepare": cmd_prepare,
        "prepare-chat": cmd_prepare_chat,
        "train": cmd_train,
        "eval": cmd_eval,
    }
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
