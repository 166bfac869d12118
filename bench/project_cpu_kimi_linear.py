"""A full-depth Kimi Linear 48B-A3B NVFP4 decode on this CPU box, projected from what this box measures.

Counted from the published tensor table (bench/configs/kimi_linear_48b_a3b.tensor-table.json) for k3run's
all-NVFP4 export (every linear but the output head, the embeddings and the routers in NVFP4: 4.5 bits a
weight with its E4M3 scale per 16; the rest as published):
- the checkpoint's bytes, the weight bytes one decode token reads at batch 1 (everything but the routed
  experts, plus top-k of each layer's experts, plus the output head),
- the bandwidth roofline: those bytes over the read bandwidth measured here (a sum over a 1 GiB buffer).
Measured here (k3run's default CPU paths):
- decode steps of the model at its real widths cut to 4 and 8 layers (layer 0's dense MLP and 3 MoE
  layers; then 3 KDA + 1 MLA MoE layers more), 16 experts (top-8: the same experts touched per token as
  with 256), the bundled tokenizer's vocabulary, built in memory, through the engine;
- the bf16 output head GEMV at the real vocabulary (163840 x 2304) and at the slice's.
Projection: t(4 layers) + 23 / 4 x (t(8) - t(4)) + (head at 163840 - head at the slice's vocabulary). The
23 layers past the fourth are 17 KDA + 6 MLA; the 5.75 four-layer groups are 17.25 + 5.75.
RAM: the model's tensors as k3run holds them after loading (summed from the 4- and 8-layer models, the
routed experts scaled to 256 a layer and 26 MoE layers) plus the caches of one 32K-token sequence.

    PYTHONPATH=src:. python bench/project_cpu_kimi_linear.py [--batch 1,4] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from k3_shaped import kimi_linear_48b_config, random_model  # noqa: E402
from write_kimi_linear import expand  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
BUNDLED = Path(__file__).resolve().parent.parent / "assets" / "default-model-bf16"
ITEM = {"BF16": 2, "F32": 4}


def _nvfp4(name: str, shape: tuple[int, ...]) -> bool:
    """Quantized in the all-NVFP4 export: 2-D linear weights but the head, the embeddings and the routers."""
    return (
        len(shape) == 2
        and name.endswith("proj.weight") | (".experts." in name)
        and not name.startswith(("lm_head", "model.embed_tokens"))
        and ".gate.weight" not in name
    )


def checkpoint_bytes() -> tuple[float, float, dict]:
    """(all bytes, bytes read per decode token at batch 1, the config) of the all-NVFP4 export."""
    table = json.loads((CONFIGS / "kimi_linear_48b_a3b.tensor-table.json").read_text())
    cfg = json.loads((CONFIGS / "kimi_linear_48b_a3b.json").read_text())
    top_k, n_exp = cfg["num_experts_per_token"], cfg["num_experts"]
    total = per_token = 0.0
    for name, (shape, dt) in expand(table).items():
        n = math.prod(shape)
        b = n * (0.5 + 1 / 16) if _nvfp4(name, shape) else n * ITEM[dt]
        total += b
        if name.startswith("model.embed_tokens"):
            per_token += shape[1] * ITEM[dt]  # one row
        elif ".experts." in name:
            per_token += b * top_k / n_exp
        else:
            per_token += b
    return total, per_token, cfg


def read_bandwidth() -> float:
    """Bytes per second of a sum over a 1 GiB fp32 buffer (best of 5), with torch's threads."""
    buf = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def head_ms(vocab: int, hidden: int) -> float:
    """Median ms of one bf16 output-head GEMV (one token) on k3run's path (the extension's bf16 GEMV where
    it applies, else torch's), weights cycled over copies past the L3."""
    copies = max(2, math.ceil(96e6 / (vocab * hidden * 2)))
    ws = [torch.randn(vocab, hidden).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, hidden).to(torch.bfloat16)
    from k3run.kernels import cpu_simd

    simd = cpu_simd.bf16_gemv_applies(x, ws[0])  # k3run's unquantized linear takes it on AVX-512
    walls = []
    for i in range(3 * copies + 6):
        t0 = time.perf_counter()
        if simd:
            cpu_simd.bf16_gemv(x, ws[i % copies])
        else:
            torch.nn.functional.linear(x, ws[i % copies])
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls[copies:])


def tensor_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(routed-expert bytes, all other bytes) of a model's parameters and buffers."""
    experts = other = 0
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        nb = t.numel() * t.element_size()
        if ".experts." in name or name.split(".")[-1].startswith(("w13", "w2")):
            experts += nb
        else:
            other += nb
    return experts, other


def decode_ms(
    layers: int, experts: int, vocab: int, batches: list[int], steps: int
) -> tuple[dict[int, float], tuple[int, int]]:
    """({batch: median ms per engine decode step}, tensor_bytes) of the model cut to `layers` layers and
    `experts` experts, built once for every batch size."""
    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.tokenizer import load_tokenizer

    hf = kimi_linear_48b_config(layers, experts)
    hf["vocab_size"] = vocab
    model = random_model(hf, device="cpu", dtype=torch.bfloat16)
    sizes = tensor_bytes(model)
    config = EngineConfig(max_num_seqs=max(batches), max_model_len=256)
    eng = LLM.from_model(model, load_tokenizer(str(BUNDLED)), config).engine
    ms = {}
    for batch in batches:
        for _ in range(batch):
            params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
            eng.add_request(list(range(100, 132)), params)
        eng.step()  # the prefill
        walls = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            walls.append((time.perf_counter() - t0) * 1e3)
        ms[batch] = statistics.median(walls[1:])
    return ms, sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    args = ap.parse_args()
    total, per_token, cfg = checkpoint_bytes()
    bw = read_bandwidth()
    vocab_small = json.loads((BUNDLED / "config.json").read_text())["text_config"]["vocab_size"]
    hidden, n_exp = cfg["hidden_size"], cfg["num_experts"]
    print(
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, read bandwidth {bw / 1e9:.1f} GB/s"
    )
    print(
        f"all-NVFP4 Kimi Linear 48B-A3B: {total / 1e9:.1f} GB of weights; {per_token / 1e9:.2f} GB read "
        f"per decode token at batch 1 -> bandwidth roofline {bw / per_token:.1f} tok/s"
    )
    h_full, h_small = head_ms(cfg["vocab_size"], hidden), head_ms(vocab_small, hidden)
    print(
        f"bf16 output head GEMV: {h_full:.1f} ms at {cfg['vocab_size']} rows, "
        f"{h_small:.2f} ms at {vocab_small}"
    )
    print(
        "| batch | 4 layers ms | 8 layers ms | per 4 layers ms | projected 27-layer step ms "
        "| projected tok/s |"
    )
    print("|---|---|---|---|---|---|")
    batches = [int(v) for v in args.batch.split(",")]
    ms4, (e4, o4) = decode_ms(4, args.experts, vocab_small, batches, args.steps)
    ms8, (e8, o8) = decode_ms(8, args.experts, vocab_small, batches, args.steps)
    for b in batches:
        t4, t8 = ms4[b], ms8[b]
        step = t4 + 23 / 4 * (t8 - t4) + (h_full - h_small)
        print(f"| {b} | {t4:.1f} | {t8:.1f} | {t8 - t4:.1f} | {step:.0f} | {b * 1e3 / step:.1f} |")
    experts_per_layer = (e8 - e4) / 4 * n_exp / args.experts
    other = o4 + 23 / 4 * (o8 - o4) + 2 * (cfg["vocab_size"] - vocab_small) * hidden * 2
    held = other + 26 * experts_per_layer
    # caches of one 32K sequence: the 7 MLA layers' latents (kv_lora_rank + rope dims, bf16) and the 20 KDA
    # layers' states (heads x head_dim^2, fp32; their conv windows are a few KB)
    mla = 7 * 32768 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    lac = cfg["linear_attn_config"]
    kda = 20 * lac["num_heads"] * lac["head_dim"] ** 2 * 4
    print(
        f"RAM: {held / 1e9:.1f} GB of tensors as loaded (routed experts {26 * experts_per_layer / 1e9:.1f} "
        f"GB), + {(mla + kda) / 1e9:.2f} GB of caches for one 32K-token sequence"
    )


if __name__ == "__main__":
    main()
