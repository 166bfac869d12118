"""The engine loop on the toy model: batching, chunked prefill, stop strings, streaming, abort."""

from __future__ import annotations

import pytest
import torch

from k3run.engine import FinishReason, SamplingParams

PROMPTS = ["a", "def f(x):", "hello world, ", "0123456789" * 3, "x = 1\ny = ", "import", "The end.", "??"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the whole sequence without a cache at every step."""
    ids = list(ids)
    out = []
    for _ in range(n):
        t = int(model.logits(torch.tensor(ids)).argmax(-1)[-1])
        out.append(t)
        ids.append(t)
    return out


def test_batched_greedy_equals_single_runs_and_the_uncached_reference(toy_llm) -> None:
    llm = toy_llm()
    batched = llm.generate(PROMPTS, GREEDY)
    assert len({tuple(o.token_ids) for o in batched}) > 4  # the toy model is not degenerate
    for prompt, out in zip(PROMPTS, batched):
        single = toy_llm(max_num_seqs=1).generate([prompt], GREEDY)[0]
        assert single.token_ids == out.token_ids, prompt
        ref = _reference_greedy(llm.engine.model, out.prompt_token_ids, GREEDY.max_tokens)
        assert out.token_ids == ref, prompt
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 12


def test_chunked_prefill_and_fewer_slots_give_the_same_tokens(toy_llm) -> None:
    full = toy_llm().generate(PROMPTS, GREEDY)
    chunked = toy_llm(max_num_batched_tokens=8, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in full]


def test_seeded_sampling_is_reproducible_across_batches(toy_llm) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = toy_llm().generate(["def f(x):"], p)[0]
    mixed = toy_llm().generate(["a", "def f(x):", "zz"], [SamplingParams(seed=1), p, SamplingParams()])[1]
    assert alone.token_ids == mixed.token_ids
    other = toy_llm().generate(["def f(x):"], SamplingParams(max_tokens=10, seed=8, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_stop_strings_stop_token_ids_and_max_tokens(toy_llm) -> None:
    llm = toy_llm()
    base = llm.generate(["hello world, "], GREEDY)[0]
    text = base.text
    stop = text[4:6]
    cut = text.find(stop)
    out = llm.generate(["hello world, "], SamplingParams(max_tokens=12, temperature=0, stop=(stop, "@@@")))[0]
    assert out.finish_reason is FinishReason.STOP and out.text == text[:cut]
    stop_id = base.token_ids[3]
    out = llm.generate(
        ["hello world, "], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_id,))
    )[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    # the stop token ends the sequence but is not rendered
    assert out.text == llm.tokenizer.decode(base.token_ids[:first])
    out = llm.generate(["hello world, "], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == base.token_ids[:3] and out.finish_reason is FinishReason.LENGTH


def test_streamed_deltas_add_up_to_the_text_and_never_show_a_stop_string(toy_llm) -> None:
    llm = toy_llm()
    base = llm.generate(["x = 1\ny = "], GREEDY)[0]
    stop = base.text[5:8]
    params = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    deltas = [o.delta for o in llm.stream("x = 1\ny = ", params)]
    final = llm.generate(["x = 1\ny = "], params)[0]
    assert "".join(deltas) == final.text == base.text[: base.text.find(stop)]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_closing_a_stream_early_aborts_and_frees_the_slot(toy_llm) -> None:
    llm = toy_llm(max_num_seqs=2)
    it = llm.stream("abc", GREEDY)
    next(it)
    assert llm.engine.cache.num_free == 1
    it.close()
    assert llm.engine.cache.num_free == 2 and not llm.engine.has_unfinished()


def test_a_rejected_prompt_leaves_nothing_queued(toy_llm) -> None:
    llm = toy_llm(max_model_len=16)
    with pytest.raises(ValueError, match="prompt has 20 tokens; max_model_len is 16"):
        llm.generate(["ok", "x" * 20], GREEDY)
    assert not llm.engine.has_unfinished() and llm.engine.cache.num_free == 8
    assert len(llm.generate(["ok"], GREEDY)[0].token_ids) == 12


def test_byte_budget_limits_concurrency_not_results(toy_llm) -> None:
    full = toy_llm().generate(PROMPTS, GREEDY)
    per_seq = toy_llm().engine.cache.plan.bytes_per_seq
    small = toy_llm(cache_bytes=int(2.5 * per_seq))
    assert small.engine.cache.num_slots == 2 and small.engine.scheduler.max_running == 2
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == [o.token_ids for o in full]


def test_probe_prefills_chunked_prompts_before_it_times_decode_steps(toy_llm) -> None:
    """bench/probe_graph_step.py's `_prefill_all`: prompts longer than a step's token budget prefill over
    several steps; the probe steps until every prompt is in the cache and takes no decode step, so its
    decode timings count decode steps only."""
    from tests.test_bench_tools import bench_module

    probe = bench_module("probe_graph_step")
    engine = toy_llm(max_num_batched_tokens=8, max_num_seqs=3).engine
    for prompt in ["0123456789" * 2, "abcdefghijk", "xy"]:
        engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    steps = 0
    real_step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return real_step()

    engine.step = counted
    probe._prefill_all(engine)
    running = engine.scheduler.running
    assert steps >= 32 // 8 and not engine.scheduler.waiting and len(running) == 3
    # decode-ready: one uncached token each (a prompt's last token may be left to the first decode step,
    # as the scheduler chunks), and no decode step taken (that would give a second output token)
    assert all(s.num_uncached == 1 and len(s.output_token_ids) <= 1 for s in running)


def test_probe_mixes_prompt_lengths_in_turn(toy_llm) -> None:
    """bench/probe_graph_step.py's --prompt-lens: a batch's prompts take the listed lengths in turn, and a
    malformed spec is refused by name."""
    from tests.test_bench_tools import bench_module

    probe = bench_module("probe_graph_step")
    assert probe._prompt_lengths("", 64) == [64]
    lens = probe._prompt_lengths("9x1+3x2", 64)
    assert lens == [9, 3, 3]
    for bad in ("9x", "ax1", "0x2"):
        with pytest.raises(SystemExit, match="--prompt-lens"):
            probe._prompt_lengths(bad, 64)
    engine = toy_llm(max_num_seqs=8).engine
    probe._add_prompts(engine, 5, lens, SamplingParams(max_tokens=2), torch.Generator().manual_seed(0), 100)
    assert [len(s.prompt_token_ids) for s in engine.scheduler.waiting] == [9, 3, 3, 9, 3]
