"""Constrained-decoding overhead: the host time to compute the next-token masks of a batch of 32 sequences
under one JSON schema, per decode step, llguidance (k3run's backend, engine/grammar.py) against xgrammar, on
the bundled model's tokenizer. Each of the 32 matchers walks the tokens of one valid document; per step:
the 32 masks (the library's work, what the engine waits for before sampling) and, apart, the engine's whole
masking of [32, V] fp32 logits on the CPU (the masks again plus one copy and the application: on a GPU the
application is a device kernel). Also the schema's compile time per request.

    PYTHONPATH=src python bench/bench_grammar.py [--tokenizer DIR]

Both libraries must be installed (xgrammar comes with the serve extra; pip install llguidance). The bundled
vocabulary has 2,056 tokens; Kimi's has 163,840, and mask time grows with the vocabulary: --tokenizer runs
another tokenizer.json (a byte-level BPE trained on any text will do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from k3run.cli import default_model_dir
from k3run.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"enum": ["metric", "imperial"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["city", "days", "units"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOC = {
    "name": "get_forecast",
    "arguments": {"city": "Paris", "days": 5, "units": "metric", "tags": ["rain", "wind"]},
}
BATCH = 32


def bench(tok, vocab: int, name: str) -> dict:
    """The engine's own path (engine/grammar.py): compile, 32 matchers, per step `mask_logits` on [32, V]
    logits (the masks and their unpacking), then each matcher consumes the document's next token."""
    import torch

    from k3run.engine.grammar import GrammarBackend

    backend = GrammarBackend(tok, vocab, prefer=name)
    schema = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    backend.compile(schema)
    compile_s = time.perf_counter() - t0
    ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    matchers = [backend.matcher(schema) for _ in range(BATCH)]
    logits = torch.zeros(BATCH, vocab)
    fills, steps = [], []
    for t in ids:
        t0 = time.perf_counter()
        backend.fill_bitmask(matchers)
        t1 = time.perf_counter()
        backend.mask_logits(logits, matchers)
        steps.append(time.perf_counter() - t1)
        fills.append(t1 - t0)
        for m in matchers:
            assert backend.consume(m, t), (name, t)
    return {
        "compile_ms": compile_s * 1e3, "fill_ms": statistics.median(fills) * 1e3,
        "step_ms": statistics.median(steps) * 1e3, "tokens": len(ids),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokenizer", default=None, help="a directory with tokenizer.json (default: bundled model)"
    )
    args = ap.parse_args()
    from pathlib import Path

    d = Path(args.tokenizer) if args.tokenizer else default_model_dir()
    tok = load_tokenizer(d)
    vocab = tok.vocab_size
    rows = {}
    for name in ("llguidance", "xgrammar"):
        try:
            rows[name] = bench(tok, vocab, name)
        except Exception as e:  # noqa: BLE001 (reported, the other backend's numbers stand)
            print(f"{name}: {type(e).__name__}: {e}")
    tokens = next(iter(rows.values()))["tokens"]
    print(f"vocabulary {vocab}, batch {BATCH}, one document of {tokens} tokens")
    print(
        "| backend | version | schema compile | masks per step (batch 32) | per sequence per token | "
        "masks + applied to CPU logits |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        from importlib.metadata import version as _version

        try:
            version = _version(name)
        except Exception:  # noqa: BLE001 (installed with --target: no metadata on the path)
            version = getattr(__import__(name), "__version__", "?")
        print(
            f"| {name} | {version} | {r['compile_ms']:.2f} ms | {r['fill_ms']:.3f} ms | "
            f"{r['fill_ms'] / BATCH * 1e3:.1f} us | {r['step_ms']:.3f} ms |"
        )


if __name__ == "__main__":
    main()
