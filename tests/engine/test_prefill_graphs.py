"""Prefills of one fresh prompt replayed from CUDA graphs (engine/runner.py PrefillGraphs).

CPU: the engine says why prefills run eagerly; a padded-prefill ForwardContext is checked and has no host
bounds. GPU (the bundled k3-mixed model, bf16): the replayed prefill of prompts padded to their bucket gives
the logits of an eager prefill of the unpadded prompt and leaves the same KDA states and MLA latents in its
cache slot; a second prompt on the same graph (new inputs at replay) too; generate() takes the graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.forward_context import ForwardContext, KDALayerCache, MLALayerCache
from k3run.testing import assert_close

BUNDLED = Path(__file__).parents[2] / "assets" / "default-model-k3-mixed"


def test_cpu_engine_prefills_eagerly_and_says_why(toy_llm) -> None:
    llm = toy_llm()
    assert llm.engine.runner.prefill_graphs is None
    assert "off" in (llm.engine.prefill_graph_blocker or "")


def test_padded_prefill_context_is_checked_and_has_no_host_bounds() -> None:
    cu = torch.tensor([0, 5, 64])
    ctx = ForwardContext(
        cu_seqlens=cu, context_lens=torch.zeros(2, dtype=torch.int64), slots=torch.tensor([1, 0]),
        seqlens_list=[64, 0], padded_prefill=True,
    )  # fmt: skip
    assert ctx.context_lens_list == [0, 0] and not ctx.is_decode and ctx.num_seqs == 2
    for host in (ctx.bounds, ctx.cu_seqlens_host):
        with pytest.raises(RuntimeError, match="no host copy"):
            host()
    with pytest.raises(ValueError, match="seqlens_list is \\[rows, 0\\]"):
        ForwardContext(
            cu_seqlens=cu, context_lens=torch.zeros(2), slots=torch.tensor([1, 0]), seqlens_list=[5, 59],
            padded_prefill=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens \\[3\\]"):
        ForwardContext(
            cu_seqlens=torch.tensor([0, 64]), context_lens=torch.zeros(1), slots=torch.tensor([1]),
            seqlens_list=[64, 0], padded_prefill=True,
        )  # fmt: skip


# the bound of the graph decode test (test_graph_decode.py GRAPH_CASES, k3-mixed in bf16): the padded step's
# linears run at another row count (other kernel configs and split-K: bf16 roundings at other points, <= 2^-9
# each), which the FP8_PB_WO layers' per-block input quantization can turn into one e4m3 step; 2^-4 relative
# RMS. A wrong row, bound or cache slot changes the logits and states by O(1).
RTOL = 2.0**-4


@pytest.mark.gpu
@pytest.mark.parametrize("n", [5, 64, 100, 300])
def test_gpu_prefill_graph_matches_the_eager_prefill(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from k3run.api import load_model
    from k3run.kernels.kda import kda_backend
    from k3run.tokenizer import load_tokenizer

    if kda_backend("cuda") != "fla":
        pytest.skip("prefill graphs need fla-core's KDA kernels")
    model = load_model(BUNDLED, dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512)
    llm = LLM.from_model(model, load_tokenizer(BUNDLED), cfg)
    engine = llm.engine
    pg = engine.runner.prefill_graphs
    assert pg is not None, engine.prefill_graph_blocker
    assert pg.sizes == [64, 128, 256, 512]
    cache = engine.cache
    g_slot, e_slot = cache.allocate(), cache.allocate()
    gen = torch.Generator().manual_seed(n)
    for trial in range(2):  # the second prompt replays the same graph with new inputs
        ids = torch.randint(0, 2000, (n,), generator=gen).tolist()
        with torch.inference_mode():
            ctx = engine.runner._context([n], [0], [e_slot])
            want = model.compute_logits(model(torch.tensor(ids, device="cuda"), ctx)[n - 1 :]).float()
            got = pg.run(ids, g_slot)
        assert_close(f"prefill graph n={n} trial {trial}", want, got, rtol=RTOL)
        for i, layer in enumerate(cache.cache.layers):
            if isinstance(layer, KDALayerCache):
                assert_close(f"KDA {i} state", layer.recurrent[e_slot], layer.recurrent[g_slot], rtol=RTOL)
                assert_close(
                    f"KDA {i} conv", layer.conv[e_slot].float(), layer.conv[g_slot].float(), rtol=RTOL
                )
            elif isinstance(layer, MLALayerCache):
                a, b = layer.latent[e_slot, :n].float(), layer.latent[g_slot, :n].float()
                assert_close(f"MLA {i} latents", a, b, rtol=RTOL)
    assert list(pg.graphs) == [pg.bucket(n)]
    cache.free(g_slot)
    cache.free(e_slot)
    # generate() replays it: one prompt, fresh
    calls = []
    replay = pg.run
    pg.run = lambda ids, slot: calls.append(len(ids)) or replay(ids, slot)  # type: ignore[method-assign]
    out = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert calls == [n] and len(out[0].token_ids) == 3
