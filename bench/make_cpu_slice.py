"""A random Kimi Linear 48B-A3B cut to a few layers and experts, written as a bf16 checkpoint in Moonshot's
naming (tests/model_builders.random_checkpoint at the published widths; the bundled model's tokenizer and
vocabulary size, so llama.cpp's converter takes it) and as k3run's all-NVFP4 ModelOpt export of it: the two
inputs of the CPU end-to-end comparison with llama.cpp (bench/llama_cpp/README.md, RESULTS.md C16).

    PYTHONPATH=src:. python bench/make_cpu_slice.py OUT_DIR [--layers 4] [--experts 64]
writes OUT_DIR/bf16 and OUT_DIR/nvfp4.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from k3_shaped import kimi_linear_48b_config  # noqa: E402

from k3run.quant.export import quantize_checkpoint  # noqa: E402
from tests.model_builders import write_checkpoint  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "assets" / "default-model-bf16"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    hf = kimi_linear_48b_config(args.layers, args.experts)
    del hf["quantization_config"]
    tok = json.loads((BUNDLED / "config.json").read_text())["text_config"]
    hf["vocab_size"] = tok["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tok:
            hf[key] = tok[key]
    write_checkpoint(out / "bf16", hf, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUNDLED / name, out / "bf16" / name)
    quantize_checkpoint(out / "bf16", out / "nvfp4", "nvfp4")
    print(f"wrote {out / 'bf16'} and {out / 'nvfp4'}")


if __name__ == "__main__":
    main()
