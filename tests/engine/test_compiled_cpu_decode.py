"""Compiled CPU decode (EngineConfig.compile_cpu_decode, engine/runner.py CompiledCpuDecoder): the static
decode step compiled whole by torch.compile gives the eager engine's greedy tokens, batched, with log-
probabilities equal to fp32 rounding.

The model is the bundled bf16 checkpoint run in fp32, not the k3-mixed one: that one quantizes FP8_PB_WO
inputs to fp8 per 1x128 block, a discontinuous step where a re-associated sum can land one fp8 rounding
apart (0.2 in a logit, seen over 64 steps), which says nothing about the compiled step's correctness.
Tolerance: the compiled step runs the same fp32 operations in a fused, re-associated order (fp32 eps 1.2e-7
per rounding, sums over <= 2056 terms); measured: logits <= 3.8e-6 apart over 96 steps. The bound, 1e-3 in a
log-probability, leaves room for the trained model's amplification of input rounding at some tokens (up to
~1e4x, bench/NOTES.md session 18) and fails any real difference (a wrong state update changes tokens)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.engine.runner import CompiledCpuDecoder
from k3run.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile needs a C++ compiler"
)
BOUND = 1e-3
BF16_MODEL = Path(__file__).resolve().parents[2] / "assets" / "default-model-bf16"


def test_compiled_cpu_decode_equals_eager() -> None:
    """Three sequences of different lengths: the batch runs compiled at 3, 2 and 1 rows and one prompt's
    context crosses the 256-token window into the 512 one. With Inductor's Python wrapper the engine's
    warm-up compiles three paths (batch 1 at the first window; batch 1 with a symbolic window; batches
    2-3 with both symbolic: their 2-expert picks are fewer than the 8 experts; the window that is the
    whole cache, 512, is no path of its own) and generate compiles nothing more. Its C++ wrapper (~2 min
    a path on 2 cores) decodes a batch of 2 without a warm-up, in a cache of 96 positions (under the
    smallest window: the window is the whole cache)."""
    from k3run.api import load_model

    if not BF16_MODEL.is_dir():
        pytest.skip("no bundled bf16 model")
    model = load_model(BF16_MODEL, dtype=torch.float32)
    tok = load_tokenizer(BF16_MODEL)
    sentence = "The os module provides a portable way of using operating system functions."
    long_prompt = " ".join([sentence] * 13)
    assert 200 < len(tok.encode(long_prompt)) < 250
    runs = {
        "python": ([long_prompt, "The os module provides", "def main():\n    "], [48, 32, 16], True, 3, 512),
        # a cache shorter than the smallest window (256): the window is the whole cache
        "cpp": (["The os module provides", "def main():\n    "], [40, 40], False, 1, 96),
    }
    for mode, (prompts, lengths, warm, paths, max_len) in runs.items():
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0) for n in lengths]
        outs = {}
        for compiled in (False, True):
            cfg = EngineConfig(
                max_num_seqs=3, max_model_len=max_len, max_num_batched_tokens=512,
                compile_cpu_decode=compiled, compile_cpu_cpp_wrapper=compiled and mode == "cpp",
            )  # fmt: skip
            llm = LLM.from_model(model, tok, cfg)
            assert isinstance(llm.engine.runner.graphs, CompiledCpuDecoder) == compiled
            if compiled and warm:
                llm.engine.runner.warm_up_graphs(3, 512)
                assert llm.engine.runner.graphs.compiles == paths, mode
            outs[compiled] = llm.generate(prompts, params)
            if compiled:  # every decode step ran compiled, nothing failed
                assert llm.engine.runner.graph_error is None
                assert llm.engine.runner.graphs.compiles == paths, mode
                assert llm.engine.runner.graphs.cpp_wrapper == (mode == "cpp")
        for eager, comp in zip(outs[False], outs[True], strict=True):
            assert comp.token_ids == eager.token_ids, mode
            a = torch.tensor([x.logprob for x in eager.logprobs])
            b = torch.tensor([x.logprob for x in comp.logprobs])
            assert float((a - b).abs().max()) <= BOUND, mode
