"""Tensor parallelism in the engine and the CLI: two gloo ranks on the CPU run the bundled bf16 model split in
two (the k3-mixed one cannot: its FP8_PB_WO o_proj would get 64 input columns per rank, under one block)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from k3run.cli import ASSETS_DIR
from k3run.distributed import TPInfo
from tests.gloo import spawn_gloo
from tests.tp_utils import free_port, torchrun_env

MODEL_DIR = ASSETS_DIR / "default-model-bf16"
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="no bundled bf16 model")
PROMPTS = ["def ", "class "]


def _generate(tp: TPInfo, overlap: bool | None = None) -> list[list[int]]:
    from k3run.api import load_model
    from k3run.engine import LLM, EngineConfig, SamplingParams
    from k3run.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    model = load_model(MODEL_DIR, dtype=torch.float32, tp_rank=tp.rank, tp_size=tp.size)
    cfg = EngineConfig(max_model_len=64, tp_size=tp.size, overlap_decode=overlap)
    llm = LLM.from_model(model, load_tokenizer(MODEL_DIR), cfg)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3)
    outs = llm.generate([*PROMPTS, "import "], [greedy, greedy, sampled])
    return [o.token_ids for o in outs]


def test_tp2_engine_matches_tp1_and_the_ranks_agree():
    """fp32 greedy under TP=2 (gloo) gives TP=1's tokens; the sampled request is identical on both ranks."""
    ranks = spawn_gloo(_generate, 2)
    assert ranks[0] == ranks[1]
    single = _generate(TPInfo())
    assert ranks[0][:2] == single[:2]
    assert len(ranks[0][2]) == 8


def test_tp2_engine_with_decode_overlap_gives_the_same_tokens():
    """Decode overlap under TP=2: the sampled tokens are broadcast from rank 0 on the device before the next
    step is launched from them; greedy and seeded outputs equal the plain TP=2 steps' on both ranks."""
    assert spawn_gloo(_generate, 2, True) == spawn_gloo(_generate, 2)


def test_llm_rejects_tp_without_a_process_group():
    from k3run.engine import LLM, EngineConfig

    with pytest.raises(ValueError, match="tp_size=2 needs an initialised torch.distributed world"):
        LLM(MODEL_DIR, config=EngineConfig(tp_size=2))


def _cli(env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "k3run.cli",
        "generate",
        str(MODEL_DIR),
        "--prompt",
        "def ",
        "--max-tokens",
        "8",
    ]
    cmd += ["--temperature", "0", "--device", "cpu", "--dtype", "fp32", "--quiet"]
    return subprocess.Popen(
        cmd, env=os.environ | env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_cli_generate_under_torchrun_env():
    """`torchrun --nproc-per-node 2 -m k3run.cli generate ...` on a CPU box: rank 0 prints what a single
    process prints, rank 1 prints nothing."""
    single = _cli({"OMP_NUM_THREADS": "1"})
    out1, err1 = single.communicate(timeout=120)
    assert single.returncode == 0, err1
    port = free_port()
    procs = [_cli(torchrun_env(r, 2, port, gloo=True)) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert outs[0][0] == out1 and out1.startswith("def ")
    assert outs[1][0] == ""


def _agree(tp: TPInfo) -> list[bool]:
    from k3run.engine.runner import all_ranks_ok

    return [all_ranks_ok(True, tp, torch.device("cpu")), all_ranks_ok(tp.rank != 1, tp, torch.device("cpu"))]


def test_graph_capture_outcome_is_agreed_by_every_rank():
    """A decode graph is kept only if every TP rank captured it (all_ranks_ok, a MIN all-reduce): a failure
    on rank 1 turns graphs off on rank 0 too. Single process: its own answer."""
    from k3run.engine.runner import all_ranks_ok

    assert spawn_gloo(_agree, 2) == [[True, False], [True, False]]
    assert all_ranks_ok(False, TPInfo(), torch.device("cpu")) is False
    assert all_ranks_ok(True, None, torch.device("cpu")) is True
