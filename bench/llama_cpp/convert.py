"""llama.cpp's HF -> GGUF converter for k3run's bf16 checkpoints, at f32 unless a 4th argument names the
output type (bf16, f16, ...; usage: bench/llama_cpp/README.md)."""

import sys

LC, MODEL, OUT = sys.argv[1:4]
OUTTYPE = sys.argv[4] if len(sys.argv) > 4 else "f32"
sys.path[:0] = [LC, LC + "/gguf-py"]
from conversion import base  # noqa: E402

# the bundled tokenizer's hash is not in llama.cpp's table; the comparisons feed token ids, never text
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf  # noqa: E402

sys.argv = ["convert_hf_to_gguf.py", MODEL, "--outfile", OUT, "--outtype", OUTTYPE]
convert_hf_to_gguf.main()
