"""Engine throughput: prefill and decode tokens/s of random prompts at several batch sizes, through
`LLMEngine` as it serves (scheduler, cache, decode graphs or compiled steps). `k3run bench` prints
`report`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3run.engine import LLMEngine


def run_bench(
    engine: LLMEngine, batch_sizes: list[int], prompt_len: int, decode_tokens: int, progress: bool = True
) -> list[tuple[int, float, float]]:
    """(batch size, prefill tokens/s, decode tokens/s) per batch size: each batch's prompts prefilled in one
    step (the engine's token budget must hold them), then decoded greedily to `decode_tokens`."""
    import torch
    from tqdm import tqdm

    from k3run.engine import SamplingParams

    max_bs = max(batch_sizes)
    vocab = engine.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.cache.device.type == "cuda" else (lambda: None)
    total_steps = sum(1 + decode_tokens - 1 for _ in batch_sizes) + 2
    results = []
    with tqdm(total=total_steps, desc="bench", unit="step", file=sys.stderr, disable=not progress) as bar:
        # one warm-up request so first-call costs (allocator, kernel compilation) stay out of the numbers
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), warm)
        while engine.has_unfinished():
            engine.step()
            bar.update(1)
        # capture the decode graphs the runs below will replay
        engine.runner.warm_up_graphs(max_bs, prompt_len + decode_tokens, prompt_len)
        for bs in batch_sizes:
            for _ in range(bs):
                engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
            sync()
            t0 = time.perf_counter()
            engine.step()  # the whole batch's prefill fits the token budget: one step
            sync()
            t1 = time.perf_counter()
            bar.update(1)
            steps = 0
            while engine.has_unfinished():
                engine.step()
                steps += 1
                bar.update(1)
            sync()
            t2 = time.perf_counter()
            results.append(
                (bs, bs * prompt_len / (t1 - t0), bs * steps / (t2 - t1) if steps else float("nan"))
            )
    return results


def report(
    engine: LLMEngine,
    model_dir: Path,
    prompt_len: int,
    decode_tokens: int,
    results: list[tuple[int, float, float]],
) -> list[str]:
    """The lines `k3run bench` prints: the set-up (tensor parallelism, how decode steps run), then a row
    per batch size."""
    tp = f", tensor parallel over {engine.config.tp_size} ranks" if engine.config.tp_size > 1 else ""
    decode = (
        "eager"
        if engine.runner.graphs is None
        else ("CUDA graphs" if engine.cache.device.type == "cuda" else "compiled (torch.compile)")
        + (", overlapped" if engine.overlap else "")
    )
    lines = [
        f"{model_dir}{tp}: prompt {prompt_len} tokens, "
        f"{decode_tokens} generated tokens per sequence; decode steps: {decode}",
        f"{'batch':>6}  {'prefill tok/s':>14}  {'decode tok/s':>13}",
    ]
    lines += [f"{bs:>6}  {pre:>14.1f}  {dec:>13.1f}" for bs, pre, dec in results]
    return lines
