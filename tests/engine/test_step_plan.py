"""ModelRunner.plan: the one place a step's way of running is decided (decode graph, prefill graph, eager).

The runner here holds stand-ins for the graph decoders (what `plan` asks of them: `accepts(batch, context)`
and `bucket(tokens)`), so the decision itself is tested without capturing anything; the engine tests run
the plans end to end (tests/engine/test_overlap.py checks the plan of every launched step).
"""

from __future__ import annotations

import torch

from k3run.engine import SamplingParams
from k3run.engine.runner import ModelRunner, StepPlan
from k3run.engine.scheduler import Batch
from k3run.engine.sequence import Sequence


class _Cache:
    device = torch.device("cpu")
    max_len = 40


class _Decoder:
    """Takes batches of up to 4 sequences at contexts of up to 32 tokens."""

    def accepts(self, batch: int, context: int) -> bool:
        return batch <= 4 and context <= 32


class _Prefill:
    def bucket(self, tokens: int) -> int | None:
        return 16 if tokens <= 16 else None


def _seq(i: int, prompt: int, cached: int, out: int = 0, **params) -> Sequence:
    seq = Sequence(
        seq_id=i, prompt="", prompt_token_ids=list(range(1, prompt + 1)), params=SamplingParams(**params)
    )
    seq.output_token_ids = list(range(out))
    seq.slot, seq.num_cached = i, cached
    return seq


def _decode(*seqs: Sequence) -> Batch:
    return Batch(list(seqs), [1] * len(seqs), is_prefill=False)


def _runner(decoder: bool = True, prefill: bool = True) -> ModelRunner:
    return ModelRunner(None, _Cache(), _Decoder() if decoder else None, _Prefill() if prefill else None)  # type: ignore[arg-type]


def test_decode_steps_replay_a_graph_where_the_decoder_takes_them() -> None:
    r = _runner()
    one = _decode(_seq(0, 5, 5, out=1), _seq(1, 3, 3, out=1))
    assert r.plan(one) == StepPlan("decode_graph")
    assert r.plan(one, ahead=1) == StepPlan("decode_graph", 1)
    five = _decode(*(_seq(i, 5, 5, out=1) for i in range(5)))  # a batch over the decoder's largest
    assert r.plan(five) == StepPlan("eager")
    long = _decode(_seq(0, 30, 32, out=3))  # context 33 with the fed token: over the decoder's limit
    assert r.plan(long) == StepPlan("eager")
    assert r.plan(_decode(_seq(0, 30, 31, out=2))) == StepPlan("decode_graph")
    assert r.plan(_decode(_seq(0, 30, 31, out=2)), ahead=1) == StepPlan("eager", 1)
    full = _decode(_seq(0, 38, 40, out=3))  # the fed token would not fit in the cache (max_len 40)
    assert r.plan(full) == StepPlan("eager")
    r.graphs.accepts = lambda batch, context: True  # type: ignore[union-attr]  # a decoder taking anything
    assert r.plan(full) == StepPlan("eager") and r.plan(long) == StepPlan("decode_graph")
    assert _runner(decoder=False).plan(one) == StepPlan("eager")


def test_prompt_logprobs_and_multi_token_steps_stay_off_the_decode_graphs() -> None:
    r = _runner()
    prompt_lp = _seq(0, 5, 4, prompt_logprobs=1)  # its last prompt token is still to be scored
    assert r.plan(_decode(prompt_lp)) == StepPlan("eager")
    chunk = Batch([_seq(0, 10, 4), _seq(1, 6, 5, out=1)], [6, 1], is_prefill=True)
    assert r.plan(chunk) == StepPlan("eager")


def test_fresh_prompts_a_bucket_holds_replay_a_prefill_graph() -> None:
    r = _runner()
    fresh = Batch([_seq(0, 12, 0)], [12], is_prefill=True)
    assert r.plan(fresh) == StepPlan("prefill_graph")
    assert r.plan(Batch([_seq(0, 20, 0)], [20], is_prefill=True)) == StepPlan("eager")  # no bucket
    assert r.plan(Batch([_seq(0, 12, 2)], [10], is_prefill=True)) == StepPlan("eager")  # not fresh
    two = Batch([_seq(0, 12, 0), _seq(1, 8, 0)], [12, 8], is_prefill=True)
    assert r.plan(two) == StepPlan("eager")  # one prompt a prefill graph
    scored = Batch([_seq(0, 12, 0, prompt_logprobs=1)], [12], is_prefill=True)
    assert r.plan(scored) == StepPlan("eager")
    assert _runner(prefill=False).plan(fresh) == StepPlan("eager")
