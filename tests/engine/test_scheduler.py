"""Admission under the sequence cap, the token budget (chunked prefill), and freeing on finish/abort."""

from __future__ import annotations

import pytest
import torch

from k3run.config import ModelConfig
from k3run.engine.cache import CacheManager, cache_layout_for, plan_cache
from k3run.engine.scheduler import Scheduler, SchedulerConfig
from k3run.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

from .conftest import TOY_HF_CONFIG

EOS = frozenset({0})


def _sched(max_num_seqs: int = 2, budget: int = 64, max_len: int = 32, slots: int | None = None) -> Scheduler:
    layout = cache_layout_for(ModelConfig.from_hf(TOY_HF_CONFIG), torch.float32)
    cache = CacheManager(
        layout, plan_cache(layout, max_len=max_len, max_num_seqs=slots or max_num_seqs), "cpu"
    )
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_len), cache)


def _seq(i: int, n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(i, "", list(range(5, 5 + n_prompt)), SamplingParams(max_tokens=max_tokens))


def test_admission_stops_at_the_sequence_cap_and_resumes_when_a_slot_frees() -> None:
    s = _sched(max_num_seqs=2)
    seqs = [_seq(i, 3, max_tokens=1 + i) for i in range(3)]
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    assert batch is not None and batch.is_prefill
    assert [q.seq_id for q in batch.seqs] == [0, 1] and batch.num_new_tokens == [3, 3]
    assert [q.slot for q in batch.seqs] == [0, 1] and s.cache.num_free == 0
    assert seqs[2].status is SequenceStatus.WAITING
    s.update(batch, [7, 8], EOS)
    # seq 0 had max_tokens 1: finished, slot 0 back; seq 2 is admitted into it on the next step
    assert seqs[0].finish_reason is FinishReason.LENGTH and seqs[0].slot is None
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [seqs[2]] and seqs[2].slot == 0
    s.update(batch, [9], EOS)
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == [seqs[1], seqs[2]] and batch.num_new_tokens == [1, 1]


def test_token_budget_splits_a_long_prompt_into_chunks() -> None:
    s = _sched(max_num_seqs=2, budget=8)
    a, b = _seq(0, 5), _seq(1, 6)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 3] and batch.num_tokens == 8
    assert batch.samples(0) and not batch.samples(1)
    s.update(batch, [7, None], EOS)
    assert a.num_cached == 5 and b.num_cached == 3 and b.output_token_ids == []
    batch = s.schedule()  # the unfinished prompt goes before any decode
    assert batch.is_prefill and batch.seqs == [b] and batch.num_new_tokens == [3] and batch.samples(0)
    s.update(batch, [9], EOS)
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b]


def test_eos_stop_ids_max_tokens_and_max_model_len_finish_and_free() -> None:
    s = _sched(max_num_seqs=4, max_len=8)
    eos = _seq(0, 2, max_tokens=10)
    stop_id = Sequence(1, "", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=(42,)))
    ignore = Sequence(2, "", [5, 6], SamplingParams(max_tokens=10, ignore_eos=True))
    full = _seq(3, 6, max_tokens=10)
    for q in (eos, stop_id, ignore, full):
        s.add(q)
    batch = s.schedule()
    s.update(batch, [0, 42, 0, 11], EOS)
    assert eos.finish_reason is FinishReason.STOP and eos.output_token_ids == [0]
    assert stop_id.finish_reason is FinishReason.STOP
    assert not ignore.is_finished
    assert full.num_tokens == 7 and not full.is_finished
    s.update(s.schedule(), [0, 12], EOS)
    assert full.finish_reason is FinishReason.LENGTH and full.num_tokens == 8  # max_model_len reached
    assert s.running == [ignore] and s.cache.num_free == 3


def test_abort_frees_running_and_waiting_sequences() -> None:
    s = _sched(max_num_seqs=1)
    a, b = _seq(0, 3), _seq(1, 3)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [7], EOS)
    assert s.cache.num_free == 0
    assert s.abort(0) is a and a.finish_reason is FinishReason.ABORT and s.cache.num_free == 1
    assert s.abort(1) is b and not s.has_unfinished()
    assert s.abort(5) is None


def test_prompt_that_leaves_no_room_is_rejected() -> None:
    s = _sched(max_len=8)
    with pytest.raises(ValueError, match="prompt has 8 tokens; max_model_len is 8"):
        s.add(_seq(0, 8))


def test_budget_must_cover_a_decode_step() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=16)
