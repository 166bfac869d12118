"""Question: does the grouped wgmma kernel's shallower ring (4 slots, two programs an SM) speed up a whole
prefill, not only one MoE layer? (bench/RESULTS.md run 122.)

The full-depth random Kimi Linear 48B-A3B NVFP4 (bench/k3_shaped.py, in memory), two engines on one model:
one with today's `grouped_config`, one with the deepest ring that fits one program an SM; each captures
its own prefill graphs; alternating calls after a warm-up. Answer (H200, run 122, when the 4-slot ring was
taken at every block size): 2048 tokens (64-pick blocks) 53.8 against 59.9 ms; 8192 tokens (128-pick
blocks, one program an SM either way) 181-183 against 178-179 ms. So `grouped_config` takes 4 slots only
where two programs then share an SM, and the two engines now differ only at 64 picks a block or fewer.

    PYTHONPATH=src:. python bench/probes/prefill_grouped_ring.py [2048,8192]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from probe_prefill import build  # noqa: E402

import k3run.kernels.nvfp4_gemm.wgmma as wg  # noqa: E402
from k3run.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from k3run.tokenizer import load_tokenizer  # noqa: E402


def deepest(bt: int, k: int) -> tuple[int, int]:
    """The ring before run 122: the deepest (<= 8 slots, <= the chunks + 2) that fits one program."""
    chunks, stages = -(-k // 128), 3
    while stages < min(8, chunks + 2) and wg.smem_bytes(128, bt, stages + 1) <= wg._SMEM_BUDGET:
        stages += 1
    return 128, stages


def main() -> None:
    lengths = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2048,8192").split(",")]
    t0 = time.perf_counter()
    model = build("kimi-linear", "cuda")
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    tok = load_tokenizer("assets/default-model-k3-mixed")
    cfg = EngineConfig(max_num_seqs=1, max_model_len=max(lengths) + 8, max_num_batched_tokens=max(lengths))
    rings = {"today": wg.grouped_config, "deepest": deepest}
    engines = {name: LLM.from_model(model, tok, cfg) for name in rings}
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for n in lengths:
        prompt = torch.randint(10, 2000, (n,)).tolist()
        for name, llm in engines.items():  # warm-up: compiles and captures with each ring
            wg.grouped_config = rings[name]
            llm.generate([prompt], params)
        for _ in range(3):
            for name, llm in engines.items():
                wg.grouped_config = rings[name]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate([prompt], params)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                print(f"{n} tokens, {name} ring: {wall * 1e3:.1f} ms, {n / wall:.0f} tok/s", flush=True)
    wg.grouped_config = rings["today"]


if __name__ == "__main__":
    main()
