"""Decode overlap (EngineConfig.overlap_decode): each decode step is launched, fed by the previous step's
sampled tokens on the device, before the previous step is recorded. On the toy model (forced on: the CPU
gains nothing, but the bookkeeping is the same) the outputs equal plain steps', rows of sequences that
finished in the meantime are dropped, and requests that arrive or are aborted mid-decode are handled."""

from __future__ import annotations

from k3run.engine import FinishReason, SamplingParams

from .conftest import ToyModel

PROMPTS = ["a", "def f(x):", "hello world, ", "x = 1\ny = ", "import"]


def _make(char_tokenizer, overlap: bool | None, **kw):
    from k3run.engine import LLM, EngineConfig

    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, overlap_decode=overlap, **kw)
    return LLM.from_model(ToyModel(), char_tokenizer, cfg)


def _count_launches(llm) -> dict[str, int]:
    """Wrap the engine's launch to count decode steps launched ahead (fed by unrecorded tokens) and rows."""
    counts = {"ahead": 0, "rows": 0}
    launch = llm.engine._launch

    def counted(batch, plan, prev):
        assert plan.ahead == (prev is not None)  # a step launched ahead is planned one position on
        counts["ahead"] += prev is not None
        counts["rows"] += len(batch.seqs)
        return launch(batch, plan, prev)

    llm.engine._launch = counted
    return counts


def _params(base_tokens: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(base_tokens[4],)),  # ends mid-run
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ]


def test_overlap_launches_ahead_and_gives_the_plain_steps_outputs(char_tokenizer) -> None:
    plain = _make(char_tokenizer, None)
    assert not plain.engine.overlap  # automatic: off without CUDA graphs
    base = plain.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    params = _params(base.token_ids)
    want = plain.generate(PROMPTS, params)
    llm = _make(char_tokenizer, True)
    counts = _count_launches(llm)
    got = llm.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert got[1].finish_reason is FinishReason.STOP and len(got[1].token_ids) < 12
    assert counts["ahead"] >= 8  # the decode steps after the first were launched ahead
    # every sequence's first token comes from its prefill; the rest from launched rows, some of them dropped:
    # the stop-token sequence had one more row launched before its stop was read
    decoded = sum(len(o.token_ids) - 1 for o in got)
    assert counts["rows"] == decoded + 1
    assert llm.engine.cache.num_free == plain.engine.cache.num_free and llm.engine._inflight is None


def _drive(llm, late_prompt: str, late_at: int, abort_id: int | None, abort_at: int):
    """Two requests, a third added after `late_at` steps and request `abort_id` aborted after `abort_at`:
    the outputs per request id, and whether a step was in flight when the late request came."""
    eng = llm.engine
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(q, p) for q in PROMPTS[:2]]
    tokens: dict[int, list[int]] = {}
    in_flight_at_add = None
    steps = 0
    while eng.has_unfinished() or steps <= late_at:
        if steps == late_at:
            in_flight_at_add = eng._inflight is not None
            ids.append(eng.add_request(late_prompt, p))
        if abort_id is not None and steps == abort_at:
            eng.abort(ids[abort_id])
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
        steps += 1
    return [tokens.get(i) for i in ids], in_flight_at_add


def test_overlap_admits_late_requests_and_drops_aborted_rows(char_tokenizer) -> None:
    want, _ = _drive(_make(char_tokenizer, None), PROMPTS[2], late_at=4, abort_id=None, abort_at=0)
    got, in_flight = _drive(_make(char_tokenizer, True), PROMPTS[2], late_at=4, abort_id=None, abort_at=0)
    assert in_flight and got == want and all(len(t) == 10 for t in got)
    # request 0 aborted mid-decode (its launched row dropped): the others are unaffected, the slots all free
    want, _ = _drive(_make(char_tokenizer, None), PROMPTS[2], late_at=6, abort_id=0, abort_at=3)
    llm = _make(char_tokenizer, True)
    got, _ = _drive(llm, PROMPTS[2], late_at=6, abort_id=0, abort_at=3)
    assert got[1:] == want[1:] and got[0] == want[0]
    assert llm.engine.cache.num_free == llm.engine.cache.num_slots and llm.engine._inflight is None
