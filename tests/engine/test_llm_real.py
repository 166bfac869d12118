"""The engine on the real Kimi model: batched greedy decoding equals single runs token for token.

Uses the committed tiny Kimi Linear checkpoint (transformers-5 naming, KDA + MLA + MoE, vocab 128) in fp32
with the character tokenizer of conftest.py. fp32: batching changes only the GEMM shapes, so logits differ by
a few ulps at most and a random model's top-2 logits are never that close (checked in the test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from k3run.engine import LLM, EngineConfig, FinishReason, SamplingParams
from tests.model_builders import K3, VOCAB, write_checkpoint

from .conftest import write_char_tokenizer

api = pytest.importorskip("k3run.api")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "kimi_linear_bf16"
PROMPTS = ["a", "def f(x):", "hello world, ", "0123456789" * 4, "x = 1\ny = ", "import os", "The end.", "??"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kimi") / "ckpt"
    shutil.copytree(FIXTURE, d)
    write_char_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def model(ckpt: Path):
    return api.load_model(ckpt, dtype=torch.float32)


def _llm(model, ckpt: Path, **kw: int) -> LLM:
    from k3run.tokenizer import load_tokenizer

    cfg = EngineConfig(**{"max_num_seqs": 8, "max_model_len": 64, "max_num_batched_tokens": 512, **kw})
    return LLM.from_model(model, load_tokenizer(ckpt), cfg)


def test_batched_greedy_equals_single_runs_token_for_token(model, ckpt: Path) -> None:
    batched = _llm(model, ckpt).generate(PROMPTS, GREEDY)
    single_llm = _llm(model, ckpt, max_num_seqs=1)
    for prompt, out in zip(PROMPTS, batched):
        single = single_llm.generate([prompt], GREEDY)[0]
        assert single.token_ids == out.token_ids, prompt
        assert len(out.token_ids) == 10 and out.finish_reason is FinishReason.LENGTH
    assert len({tuple(o.token_ids) for o in batched}) > 4


def test_cached_decode_matches_full_recompute(model, ckpt: Path) -> None:
    outs = _llm(model, ckpt, max_num_batched_tokens=16).generate(PROMPTS[:4], GREEDY)  # chunked prefill too
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        logits = model.logits(torch.tensor(ids))  # [T, vocab] fp32, no cache
        n = len(out.prompt_token_ids)
        ref = logits[n - 1 : -1].argmax(-1).tolist()
        top2 = logits[n - 1 : -1].topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # no near-ties that fp32 rounding could flip
        assert out.token_ids == ref


def test_llm_from_directory_and_seeded_sampling(ckpt: Path) -> None:
    llm = LLM(ckpt, dtype=torch.float32, config=EngineConfig(max_num_seqs=4, max_model_len=48))
    p = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    a = llm.generate(["def f(x):", "abc"], [p, SamplingParams(seed=5)])[0]
    b = llm.generate(["def f(x):"], p)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_cache_layout_matches_the_models_own_cache(model) -> None:
    from k3run.engine.cache import cache_layout_for

    mine = cache_layout_for(model.config, model.params_dtype).allocate(3, 20, "cpu")
    theirs = model.make_cache(3, 20)
    assert len(mine.layers) == len(theirs.layers)
    for a, b in zip(mine.layers, theirs.layers):
        assert type(a) is type(b)
        for name in vars(a):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta.shape, ta.dtype) == (tb.shape, tb.dtype), name


def test_k3_batched_greedy_equals_single_runs(tmp_path: Path) -> None:
    """The same on a tiny random K3 (AttnRes across closed blocks, latent MoE with SiTU, q_lora, gated MLA,
    lower-bound KDA gate), written by the shared tiny-model checkpoint builder."""
    d = write_checkpoint(tmp_path / "k3", K3, seed=11)
    write_char_tokenizer(d, chars=[chr(c) for c in range(32, 32 + VOCAB - 2)])
    llm = LLM(d, dtype=torch.float32, config=EngineConfig(max_num_seqs=8, max_model_len=56))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    single = LLM(d, dtype=torch.float32, config=EngineConfig(max_num_seqs=1, max_model_len=56))
    for prompt, out in zip(PROMPTS, batched):
        assert single.generate([prompt], params)[0].token_ids == out.token_ids, prompt
    assert len({tuple(o.token_ids) for o in batched}) > 4


def test_logprobs_are_the_models_log_softmax(model, ckpt: Path) -> None:
    """SamplingParams.logprobs: each generated token's log-probability and the top k equal log_softmax of a
    full no-cache forward (fp32), for greedy and sampled requests (raw logits: before temperature / top-k)."""
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=1, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    outs = _llm(model, ckpt).generate(PROMPTS[:3], params)
    assert outs[2].logprobs is None
    for out, k in zip(outs[:2], (3, 0)):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
        ids = out.prompt_token_ids + out.token_ids
        n = len(out.prompt_token_ids)
        ref = torch.log_softmax(model.logits(torch.tensor(ids))[n - 1 : -1], dim=-1)  # [6, vocab]
        for t, lp in enumerate(out.logprobs):
            assert lp.token_id == out.token_ids[t]
            assert abs(lp.logprob - ref[t, lp.token_id].item()) < 1e-4
            assert len(lp.top) == k
            want = ref[t].topk(k) if k else None
            if want is not None:
                assert [i for i, _ in lp.top] == want.indices.tolist()
                assert max(abs(v - w) for (_, v), w in zip(lp.top, want.values.tolist())) < 1e-4
        if k:  # greedy: the chosen token is the most likely one
            assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)


def test_prompt_logprobs_cover_every_prompt_token_across_prefill_chunks(model, ckpt: Path) -> None:
    """SamplingParams.prompt_logprobs: None for the first prompt token, then each prompt token's
    log-probability given the tokens before it, equal to a full no-cache forward, also when the prefill is
    split into chunks of 16 tokens (the 40-token prompt spans three steps)."""
    prompt = PROMPTS[3]  # 40 characters
    for budget in (512, 16):
        out = _llm(model, ckpt, max_num_batched_tokens=budget).generate(
            [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
        )[0]
        ids = out.prompt_token_ids
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) > 16
        assert out.prompt_logprobs[0] is None
        ref = torch.log_softmax(model.logits(torch.tensor(ids))[:-1], dim=-1)  # row t predicts ids[t + 1]
        for t, lp in enumerate(out.prompt_logprobs[1:]):
            assert lp.token_id == ids[t + 1]
            assert abs(lp.logprob - ref[t, ids[t + 1]].item()) < 1e-4
            assert [i for i, _ in lp.top] == ref[t].topk(2).indices.tolist()
    plain = _llm(model, ckpt).generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids
