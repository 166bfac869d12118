"""Where a replayed decode step's time goes: the GPU time of graph.replay() (CUDA events around it) against
the wall time of the whole engine step (scheduler, input copy, replay, logits copy, sampler, detokenizer).

    PYTHONPATH=src python bench/probe_graph_step.py [MODEL_DIR] [--batch-sizes 1,8] [--steps 48]

Prints per batch size: wall ms per step, GPU ms per replay, the share of the step the GPU is busy, and
decode tokens/s. Needs CUDA (and fla-core for KDA models).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from k3run.api import load_model
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.tokenizer import load_tokenizer

DEFAULT = Path(__file__).parents[1] / "assets" / "default-model-k3-mixed"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(DEFAULT))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(max_num_seqs=max(sizes), max_model_len=args.prompt_len + args.steps + 2)
    engine = LLM.from_model(model, load_tokenizer(args.model), cfg).engine
    dec = engine.runner.graphs
    if dec is None:
        raise SystemExit(f"decode runs eagerly: {engine.graph_blocker}")
    with torch.inference_mode():
        dec.warm_up(max(sizes), args.prompt_len + args.steps + 1)
    gpu_ms: list[float] = []
    replay = dec.run

    def timed(ids: list[int], slots: list[int], ctx_lens: list[int]) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(ids, slots, ctx_lens)
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
        return out

    dec.run = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.8, ignore_eos=True)
    print(f"{torch.cuda.get_device_name()}, {args.model}")
    print(f"{'batch':>5} {'wall ms/step':>13} {'replay GPU ms':>14} {'GPU busy':>9} {'decode tok/s':>13}")
    for b in sizes:
        for _ in range(b):
            engine.add_request(torch.randint(0, 2000, (args.prompt_len,), generator=g).tolist(), params)
        engine.step()  # prefill
        gpu_ms.clear()
        walls = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1e3)
        wall, gpu = statistics.median(walls), statistics.median(gpu_ms)
        print(f"{b:>5} {wall:>13.3f} {gpu:>14.3f} {gpu / wall:>8.0%} {b / wall * 1e3:>13.1f}")


if __name__ == "__main__":
    main()
