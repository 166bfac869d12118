"""Builds the flat batch and ForwardContext for one step and returns the logits that need sampling."""

from __future__ import annotations

from typing import Protocol

import torch

from k3run.engine.cache import CacheManager
from k3run.engine.scheduler import Batch
from k3run.forward_context import ForwardContext


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheManager) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, ForwardContext]:
        ids: list[int] = []
        seqlens: list[int] = []
        ctx_lens: list[int] = []
        slots: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.slot is None:
                raise RuntimeError(f"sequence {seq.seq_id} is scheduled without a cache slot")
            if seq.num_cached + n > self.cache.max_len:
                raise RuntimeError(
                    f"sequence {seq.seq_id} would reach {seq.num_cached + n} tokens; the cache holds "
                    f"{self.cache.max_len}"
                )
            ids.extend(seq.all_token_ids[seq.num_cached : seq.num_cached + n])
            seqlens.append(n)
            ctx_lens.append(seq.num_cached)
            slots.append(seq.slot)
        cu = [0]
        for n in seqlens:
            cu.append(cu[-1] + n)
        dev = self.device
        ctx = ForwardContext(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int64, device=dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            cache=self.cache.cache,
            seqlens_list=seqlens,
            context_lens_list=ctx_lens,
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), ctx  # [T]

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[list[int], torch.Tensor | None]:
        """One step; returns the batch rows that end their known tokens and those rows' logits [B', vocab].

        Sequences that asked for prompt log-probabilities and feed prompt tokens in this step get the logits
        of every position they feed in `self.prompt_logits[b]` ([n_b, vocab] fp32, set by each call)."""
        input_ids, ctx = self.prepare(batch)
        hidden = self.model.forward(input_ids, ctx)  # [T, D]
        self.prompt_logits: dict[int, torch.Tensor] = {}
        lo = 0
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.params.prompt_logprobs is not None and seq.num_cached < len(seq.prompt_token_ids):
                self.prompt_logits[b] = self.model.compute_logits(hidden[lo : lo + n]).float()
            lo += n
        rows = [b for b in range(len(batch.seqs)) if batch.samples(b)]
        if not rows:
            return rows, None
        last = ctx.cu_seqlens[1:] - 1  # [B]
        pick = last[torch.tensor(rows, device=last.device)]
        return rows, self.model.compute_logits(hidden.index_select(0, pick)).float()
