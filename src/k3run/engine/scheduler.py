"""Forms prefill and decode batches under a token budget and a sequence cap.

Prefill first (nano-vllm's policy): while prompts wait and slots are free, a step prefills as many prompt
tokens as the budget allows, splitting a long prompt into chunks across steps (its KDA state and MLA latents
carry over through the cache, so a chunk starts at context_len > 0). With a prefix cache an admitted prompt
starts after its longest stored prefix, and a chunk ends at the prompt's snapshot point (prefix_cache.py).
Otherwise a step decodes one token for every running sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from k3run.engine.cache import CacheManager
from k3run.engine.prefix_cache import PrefixCache
from k3run.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # a decode step feeds one token per running sequence and must fit the budget
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )


@dataclass
class Batch:
    """One model step: sequence b feeds `num_new_tokens[b]` tokens starting at its `num_cached`."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, b: int) -> bool:
        """Whether this step ends sequence b's known tokens (so its last logits give a new token)."""
        seq = self.seqs[b]
        return seq.num_cached + self.num_new_tokens[b] == seq.num_tokens


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, cache: CacheManager, prefix: PrefixCache | None = None
    ) -> None:
        if config.max_model_len > cache.max_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the cache's {cache.max_len} tokens a sequence"
            )
        self.config = config
        self.cache = cache
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def max_running(self) -> int:
        return min(self.config.max_num_seqs, self.cache.num_slots)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: the prompt has {seq.num_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, which leaves no room to generate"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        # prompts already part-way through a chunked prefill go first so they finish before new admissions
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncached > 1:
                n = self._chunk(seq, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.num_cached = 0
            if self.prefix is not None:  # a stored prefix of the prompt is copied in and not computed again
                seq.num_cached = self.prefix.restore(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return None
        return Batch(seqs=seqs, num_new_tokens=counts, is_prefill=True)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The next prefill chunk of seq: what the budget allows, ending at the prefix cache's next snapshot
        point (the engine snapshots the state there after the step)."""
        n = min(seq.num_uncached, budget)
        if self.prefix is not None:
            point = self.prefix.next_point(seq, seq.num_cached)
            if point is not None:
                n = min(n, point - seq.num_cached)
        return n

    def _schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        seqs = self.running[: self.config.max_num_batched_tokens]
        return Batch(seqs=list(seqs), num_new_tokens=[1] * len(seqs), is_prefill=False)

    def update(self, batch: Batch, sampled: list[int | None], eos_token_ids: frozenset[int]) -> None:
        """Record a finished step: advance the cached counts, append sampled tokens, apply token-level stops.

        `sampled[b]` is None for a sequence whose prompt chunk did not reach its end. Stop strings are checked
        by the engine after detokenising, through `finish`.
        """
        for b, seq in enumerate(batch.seqs):
            seq.num_cached += batch.num_new_tokens[b]
            token = sampled[b]
            if token is None:
                continue
            seq.output_token_ids.append(token)
            params = seq.params
            if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
                self.finish(seq, FinishReason.STOP)
            elif (
                len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.config.max_model_len
            ):
                self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (finished or aborted) and give its slot back."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        seq.finish(reason)

    def abort(self, seq_id: int) -> Sequence | None:
        for seq in [*self.running, *self.waiting]:
            if seq.seq_id == seq_id:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None
