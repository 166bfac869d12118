"""k3run vs llama.cpp's kimi-k3 graph: fp32 logits of the bundled bf16 model on held-out windows (usage:
bench/llama_cpp/README.md; results in bench/RESULTS.md C10)."""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from k3run.api import load_model
from k3run.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "default-model-bf16"
GGUF, DUMP = sys.argv[1], sys.argv[2]
WINDOWS, T = int(sys.argv[3]) if len(sys.argv) > 3 else 6, 256

tok = load_tokenizer(MODEL)
model = load_model(MODEL, dtype=torch.float32)
ids_all = tok.encode((ROOT / "assets" / "heldout.txt").read_text(), add_special_tokens=False)
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for w in range(WINDOWS):
        ids = ids_all[w * 997 : w * 997 + T]
        ours = model.logits(torch.tensor(ids)).float().numpy()
        out = f"{tmp}/logits.bin"
        subprocess.run([DUMP, GGUF, ",".join(map(str, ids)), out, "2"], check=True, capture_output=True)
        theirs = np.fromfile(out, dtype=np.float32).reshape(T, -1)[:, : ours.shape[1]]
        for n in (16, 64, 128, 256):
            rel = np.linalg.norm(ours[:n] - theirs[:n]) / np.linalg.norm(theirs[:n])
            rows.append((n, rel, (ours[:n].argmax(-1) == theirs[:n].argmax(-1)).mean()))
rows_a = np.array(rows)
print("| first tokens | relative logit difference, median / max | top-1 agreement |")
print("|---|---|---|")
for n in (16, 64, 128, 256):
    sel = rows_a[rows_a[:, 0] == n]
    print(f"| {n} | {np.median(sel[:, 1]):.2e} / {sel[:, 1].max():.2e} | {sel[:, 2].mean():.4f} |")
