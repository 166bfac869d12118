"""Tensor parallelism with CUDA graphs: two NCCL ranks (one GPU each, the torchrun environment) run the
bundled bf16 model split in two, with decode steps captured and replayed (the all-reduces and all-gathers
inside the graphs), against the same ranks decoding eagerly and against one GPU. Needs 2 GPUs and fla-core
(KDA's kernels; without them the model states why it decodes eagerly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3run.cli import ASSETS_DIR
from tests.tp_utils import free_port, torchrun_env

MODEL_DIR = ASSETS_DIR / "default-model-bf16"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="no bundled bf16 model"),
]

_SCRIPT = r"""
import json, sys, torch
from k3run.api import load_model
from k3run.distributed import exit_rank, init_distributed, shutdown_distributed
from k3run.engine import LLM, EngineConfig, SamplingParams
from k3run.tokenizer import load_tokenizer

tp = init_distributed()
model_dir, both = sys.argv[1], sys.argv[2] == "1"
device = f"cuda:{torch.cuda.current_device()}"
model = load_model(model_dir, dtype=torch.float32, device=device, tp_rank=tp.rank, tp_size=tp.size)
greedy = SamplingParams(max_tokens=12, temperature=0.0)
sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=3)
res = {}
for graphs in ((True, False) if both else (True,)):
    llm = LLM.from_model(
        model, load_tokenizer(model_dir),
        EngineConfig(max_model_len=64, max_num_seqs=4, tp_size=tp.size, cuda_graphs=graphs),
    )
    outs = llm.generate(["def ", "class ", "import ", "for i in"], [greedy, greedy, greedy, sampled])
    decoder = llm.engine.runner.graphs
    res["graphs" if graphs else "eager"] = dict(
        blocker=llm.engine.graph_blocker, graphs=0 if decoder is None else len(decoder.graphs),
        tokens=[o.token_ids for o in outs],
    )
    print(json.dumps(res), file=sys.stderr, flush=True)
print(json.dumps(res))
if shutdown_distributed():
    exit_rank(0)  # no interpreter finalization: a gloo rank can abort there (k3run.distributed.exit_rank)
"""


def _run(world: int, both: bool, model_dir: Path = MODEL_DIR) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, str(model_dir), "1" if both else "0"],
            env=torchrun_env(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_tp2_nccl_graph_decode_matches_eager_and_one_gpu():
    """Graphs on under TP = 2 (NCCL): no blocker, graphs captured, every rank emits the same tokens, and
    greedy fp32 tokens equal the eager TP = 2 decode's (same processes, graphs off) and one GPU's (the static
    step attends over a masked window and TP splits the reductions: fp32 rounding only, far from a greedy
    tie in 12 tokens); the sampled request (same seed) matches too."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from k3run.kernels.kda import kda_backend

    if kda_backend(torch.device("cuda")) != "fla":
        pytest.skip("KDA graphs need fla-core")
    tp = _run(2, True)
    for o in tp:
        assert o["graphs"]["blocker"] is None and o["graphs"]["graphs"] > 0, o
        assert o["eager"]["blocker"] is not None and o["eager"]["graphs"] == 0, o
    assert tp[0]["graphs"]["tokens"] == tp[1]["graphs"]["tokens"]
    assert tp[0]["graphs"]["tokens"] == tp[0]["eager"]["tokens"]
    single = _run(1, False)[0]["graphs"]
    assert single["blocker"] is None
    assert tp[0]["graphs"]["tokens"][:3] == single["tokens"][:3]


@pytest.mark.parametrize("world", [4, 8])
def test_tp4_and_tp8_nccl_graph_decode(tmp_path, world: int):
    """Issue 23's first run on 4 and 8 GPUs of one host: the tiny Kimi Linear widened to 8 KDA and 8 MLA heads
    (one head and one routed expert a rank at 8) under TP = 4 / 8 on NCCL, graphs captured on every rank, the
    same tokens on every rank, greedy tokens equal to the eager TP run's and one GPU's (fp32)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from k3run.kernels.kda import kda_backend
    from tests.engine.conftest import CHARS, write_char_tokenizer
    from tests.model_builders import KIMI_LINEAR, VOCAB, write_checkpoint
    from tests.models.test_kimi_model import _wide

    if kda_backend(torch.device("cuda")) != "fla":
        pytest.skip("KDA graphs need fla-core")
    d = write_checkpoint(tmp_path / "wide", _wide(KIMI_LINEAR), 5)
    write_char_tokenizer(d, CHARS[: VOCAB - 2])
    tp = _run(world, True, d)
    for o in tp:
        assert o["graphs"]["blocker"] is None and o["graphs"]["graphs"] > 0, o
    assert all(o["graphs"]["tokens"] == tp[0]["graphs"]["tokens"] for o in tp[1:])
    assert tp[0]["graphs"]["tokens"] == tp[0]["eager"]["tokens"]
    single = _run(1, False, d)[0]["graphs"]
    assert tp[0]["graphs"]["tokens"][:3] == single["tokens"][:3]
