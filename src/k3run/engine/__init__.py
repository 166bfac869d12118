"""Sequences, scheduler, cache manager, model runner, sampler and the `LLM` API."""

from __future__ import annotations

from k3run.engine.llm import LLM, EngineConfig, LLMEngine
from k3run.engine.sequence import FinishReason, RequestOutput, SamplingParams, TokenLogprob

__all__ = [
    "LLM",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
