"""A full-depth Kimi Linear 48B-A3B NVFP4 on this CPU, projected from measured cuts of it: the decode step of
random-weight models with the published widths (bench/configs/, all-NVFP4 export, 256 experts) cut to its
first 1..4 layers, timed through the engine at batch 1. Layer 1 is KDA with the dense MLP, layers 2-3 KDA with
MoE, layer 4 MLA with MoE, so T(1) (embeddings, head, layer 1), (T(3) - T(1)) / 2 (a KDA + MoE layer) and
T(4) - T(3) (an MLA + MoE layer) give the 27-layer step: T(1) + 19 x KDA-MoE + 7 x MLA-MoE. RAM: the
parameters' bytes, also extrapolated by layer kind. Prints both beside the bandwidth bound (bytes touched
per token / the measured read bandwidth). Usage: python bench/project_cpu_full_depth.py [--tokens N]"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from k3_shaped import kimi_linear_48b_config, random_model  # noqa: E402

from k3run.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


class _NoTok:
    eos_token_ids = frozenset()
    vocab_size = 1
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def encode(self, text, add_special_tokens=True):
        return [1]


def read_bandwidth() -> float:
    """Bytes per second that a sum over 1 GiB (far past every cache) reads, best of 5."""
    a = torch.ones(1 << 28, dtype=torch.float32)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def step_ms(layers: int, tokens: int) -> tuple[float, int]:
    model = random_model(kimi_linear_48b_config(layers=layers), device="cpu", dtype=torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = EngineConfig(max_num_seqs=1, max_model_len=256, max_num_batched_tokens=256)
    eng = LLMEngine(model, _NoTok(), cfg)
    eng.add_request(list(range(1, 17)), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    del eng, model
    gc.collect()
    decode = sorted(times[3:])  # the first step is the prefill, then two warm-up steps
    return 1000 * decode[len(decode) // 2], nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    bw = read_bandwidth()
    t, nb = {}, {}
    for n in (1, 2, 3, 4):
        t[n], nb[n] = step_ms(n, args.tokens)
        gib = nb[n] / 2**30
        print(f"{n} layers: {t[n]:.1f} ms a decode step (median), {gib:.2f} GiB of parameters", flush=True)
    kda, mla = (t[3] - t[1]) / 2, t[4] - t[3]
    total = t[1] + 19 * kda + 7 * mla
    ram = nb[1] + 19 * (nb[3] - nb[1]) / 2 + 7 * (nb[4] - nb[3])
    print(
        f"KDA + MoE layer {kda:.1f} ms, MLA + MoE layer {mla:.1f} ms, "
        f"embeddings + head + layer 1 {t[1]:.1f} ms"
    )
    print(
        f"projected 27-layer decode: {total:.0f} ms a token = {1000 / total:.2f} tok/s at batch 1; "
        f"parameters {ram / 2**30:.1f} GiB"
    )
    # bytes a batch-1 token reads: every non-expert parameter, 8 + 1 (shared) experts per MoE layer
    cfg = kimi_linear_48b_config()
    e_bytes = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * (0.5 + 1 / 16 * 1.0)  # E2M1 + E4M3 / 16
    routed_all = 26 * cfg["num_experts"] * e_bytes
    touched = ram - routed_all + 26 * cfg["num_experts_per_token"] * e_bytes
    print(
        f"bandwidth bound: {touched / 2**30:.2f} GiB touched a token / {bw / 1e9:.1f} GB/s read = "
        f"{bw / touched:.1f} tok/s; the projection is {100 * (1000 / total) / (bw / touched):.0f}% of it"
    )


if __name__ == "__main__":
    main()
