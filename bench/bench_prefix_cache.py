"""Time to first token with a shared prompt prefix, prefix cache warm against cold (engine/prefix_cache.py).

A 4096-token shared prefix (random token ids) with distinct 64-token tails: "no prefix cache" is a prompt on
an engine without one, "cold" the first prompt on a fresh engine with one (its prefill split at the snapshot
points), "warm" a second prompt with the same prefix and another tail on that engine. Median of `--repeats`
fresh engines. Runs on the CPU (the bundled model) or, with --device cuda, on a GPU.

    PYTHONPATH=src python bench/bench_prefix_cache.py [--prefix 4096] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3run.api import load_model
from k3run.cli import default_model_dir
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.tokenizer import load_tokenizer


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    d = default_model_dir()
    model, tok = load_model(d, dtype=torch.bfloat16, device=args.device), load_tokenizer(d)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(10, 2000, (args.prefix,), generator=g).tolist()
    tails = [torch.randint(10, 2000, (args.tail,), generator=g).tolist() for _ in range(3)]
    n = args.prefix + args.tail
    cfg = EngineConfig(
        max_num_seqs=1, max_model_len=n + 8, max_num_batched_tokens=n, prefix_cache_bytes=1 << 30
    )
    off_cfg = EngineConfig(**{**cfg.__dict__, "prefix_cache_bytes": 0})
    off, cold, warm = [], [], []
    for _ in range(args.repeats):
        off.append(ttft(LLM.from_model(model, tok, off_cfg), shared + tails[2]))
        llm = LLM.from_model(model, tok, cfg)
        cold.append(ttft(llm, shared + tails[0]))
        warm.append(ttft(llm, shared + tails[1]))
        pc = llm.engine.prefix_cache
    o, c, w = statistics.median(off), statistics.median(cold), statistics.median(warm)
    print(
        f"bundled model on {args.device}, {args.prefix}-token shared prefix + {args.tail}-token tail, "
        f"time to the first token: no prefix cache {o * 1e3:.1f} ms, cold {c * 1e3:.1f} ms (prefill split at "
        f"the snapshot points), warm {w * 1e3:.1f} ms: {o / w:.1f}x faster than without the cache"
    )
    print(
        f"last engine: {pc.hits} hit, {pc.hit_tokens} tokens restored, {len(pc)} snapshots, "
        f"{pc.used_bytes / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
