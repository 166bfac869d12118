"""Turn the trained bf16 checkpoint into k3run's bundled assets.

  assets/default-model-bf16/       the bf16 original (what `k3run eval --reference` compares against)
  assets/default-model-k3-mixed/   the same weights quantized with the k3-mixed recipe (NVFP4 routed experts,
                                   FP8_PB_WO attention projections, the rest bf16): the README's model
  assets/heldout.txt               held-out stdlib text (files the tokenizer and the model never saw)

Usage (after scripts/train_default_model.py prepare + train; the shipped model also went through
prepare-chat + train --chat-data, so its tokenizer files carry the chat template and eos ids):
  python scripts/make_default_model.py --bf16 out/default_model/bf16 --data out/default_model --assets assets
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Budget for everything under assets/ (issue 5: at most 12 MB).
ASSETS_BUDGET_BYTES = 12_000_000
HELDOUT_MIN_BYTES = 40_000
BF16_NAME = "default-model-bf16"
QUANT_NAME = "default-model-k3-mixed"
# Files of the trained checkpoint that are shipped; train_log.json stays with the bf16 original.
SHIPPED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def heldout_text(data: Path) -> str:
    """Whole held-out files (sorted by path) until at least HELDOUT_MIN_BYTES, as in the manifest of prepare.

    Read from the running interpreter's stdlib; the manifest records which Python produced the split.
    """
    manifest = json.loads((data / "manifest.json").read_text())
    root = Path(manifest["stdlib"])
    parts: list[str] = []
    size = 0
    for rel in manifest["heldout_files"]:
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(f"held-out file {path} (from {data / 'manifest.json'}) is missing")
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        parts.append(text)
        size += len(text.encode())
        if size >= HELDOUT_MIN_BYTES:
            break
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", default="out/default_model/bf16", help="trained bf16 checkpoint directory")
    ap.add_argument("--data", default="out/default_model", help="output directory of `prepare`")
    ap.add_argument("--assets", default="assets")
    args = ap.parse_args(argv)

    from k3run.quant.export import quantize_checkpoint

    src, assets = Path(args.bf16), Path(args.assets)
    bf16_dir, quant_dir = assets / BF16_NAME, assets / QUANT_NAME
    for d in (bf16_dir, quant_dir):
        if d.exists():
            shutil.rmtree(d)
    bf16_dir.mkdir(parents=True)
    for name in SHIPPED:
        shutil.copyfile(src / name, bf16_dir / name)
    shutil.copyfile(src / "train_log.json", bf16_dir / "train_log.json")
    quantize_checkpoint(bf16_dir, quant_dir, "k3-mixed", progress=False)
    # the quantizer copies every side file; the training log belongs to the original only
    (quant_dir / "train_log.json").unlink(missing_ok=True)
    (assets / "heldout.txt").write_text(heldout_text(Path(args.data)), encoding="utf-8")

    from k3run.tokenizer import load_tokenizer

    for d in (bf16_dir, quant_dir):  # what `k3run serve` reads for /v1/chat/completions
        tok = load_tokenizer(d)
        template = "a chat template" if tok.chat_template else "NO chat template"
        print(f"{d.name}: vocab {tok.vocab_size}, eos ids {sorted(tok.eos_token_ids)}, {template}")

    sizes = {str(p.relative_to(assets)): p.stat().st_size for p in sorted(assets.rglob("*")) if p.is_file()}
    total = sum(sizes.values())
    for name, n in sizes.items():
        print(f"{n:>10,d}  {name}")
    print(f"{total:>10,d}  total (budget {ASSETS_BUDGET_BYTES:,d})")
    if total > ASSETS_BUDGET_BYTES:
        sys.exit(f"assets/ is {total} bytes, over the {ASSETS_BUDGET_BYTES} byte budget")


if __name__ == "__main__":
    main()
