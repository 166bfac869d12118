"""Tensor parallelism of the linears: TP = 1 vs 2 vs 4 (vs 8) in fp32 for column, row and KDA-like merged
layers in all three schemes, loaded through load_checkpoint from a safetensors file.

Simulated ranks (one process, no collectives) cover tp 8 cheaply; two spawned gloo groups (tp 2, tp 4) run
the real all-gather / all-reduce. Tolerance: the same fp32 operands, only the summation order of the
matmul (and of the row-parallel partial sums) differs: RMS ~ sqrt(K) * 2^-24 for K <= 512, so rtol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3run.distributed import TPInfo
from k3run.knobs import reset_knobs
from k3run.layers.linear import ColumnParallelLinear, RowParallelLinear
from k3run.loader import load_checkpoint
from k3run.quant.schemes import Fp8PbWoScheme, Segment
from k3run.testing import RTOL, assert_close
from tests.gloo import spawn_gloo
from tests.tp_utils import (
    KDA_REPLICATED,
    KDA_SHARDS,
    KINDS,
    TPBlock,
    activation_reference,
    checkpoint_tensors,
    dequantized,
    free_port,
    load_shards,
    torchrun_env,
    tp_block_checkpoint,
    tp_block_forward,
    tp_block_mapping,
)

REPLICATED_NAME = KDA_SHARDS[KDA_REPLICATED][0]


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp") / "model.safetensors"
    save_file(tp_block_checkpoint(), str(path))
    return path


@pytest.fixture(scope="module")
def tp1_outputs(ckpt_path: Path) -> dict[str, torch.Tensor]:
    block = TPBlock(TPInfo())
    load_checkpoint(block, ckpt_path, tp_block_mapping, progress=False)
    return tp_block_forward(block)


def _assemble(per_rank: list[dict[str, torch.Tensor]], gathered: bool) -> dict[str, torch.Tensor]:
    """Rank-local outputs -> global ones: column parts concatenated (unless already gathered), row parts
    summed (unless already reduced), KDA shards concatenated except the replicated f_a."""
    out = {}
    for key in per_rank[0]:
        parts = [o[key] for o in per_rank]
        if key.endswith(REPLICATED_NAME):
            for r, p in enumerate(parts):
                assert torch.equal(p, parts[0]), f"{key}: rank {r} differs from rank 0"
            out[key] = parts[0]
        elif gathered and not key.startswith("kda_"):
            for r, p in enumerate(parts):
                assert torch.equal(p, parts[0]), f"{key}: rank {r} got a different collective result"
            out[key] = parts[0]
        elif key.startswith("row_"):
            out[key] = torch.stack(parts).sum(0)
        else:
            out[key] = torch.cat(parts, dim=-1)
    return out


def _compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tp: int) -> None:
    assert sorted(ref) == sorted(got)
    for key in ref:
        assert_close(f"tp{tp} {key}", ref[key], got[key], rtol=RTOL[torch.float32])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_simulated_ranks_match_tp1(tp: int, ckpt_path: Path, tp1_outputs: dict[str, torch.Tensor]) -> None:
    """Every rank loads from the same file (reading only its slices) and computes its local part."""
    # FP8 row-parallel needs K/tp % 128 == 0: ROW_K = 512 allows tp <= 4 (tp 8 FP8: the next test)
    per_rank = []
    for r in range(tp):
        block = TPBlock(TPInfo(r, tp), kinds=KINDS if tp <= 4 else ("none", "nvfp4"), collectives=False)
        load_checkpoint(block, ckpt_path, _mapping_for(block), progress=False)
        per_rank.append(tp_block_forward(block))
    got = _assemble(per_rank, gathered=False)
    _compare({k: v for k, v in tp1_outputs.items() if k in got}, got, tp)


def _mapping_for(block: TPBlock):  # type: ignore[no-untyped-def]
    return lambda name: tp_block_mapping(name, block)


def test_fp8_tp8_kda_shards_and_replicated_block_scale(ckpt_path: Path, tp1_outputs: dict) -> None:
    """At tp 8 the 96-row b_proj gives 12 rows per rank inside its single 128-row scale block, which every
    rank loads (upstream's replicate_block_scale); q/k/g give 64 rows, half a block."""
    per_rank = []
    for r in range(8):
        block = TPBlock(TPInfo(r, 8), kinds=("fp8",), collectives=False, layers=("col", "kda"))
        load_checkpoint(block, ckpt_path, _mapping_for(block), progress=False)
        kda = block.kda_fp8
        assert kda.local_output_sizes == (64, 64, 64, 128, 12)
        # every partition starts on its own block: 64-row shards are padded to 128
        assert kda.weights.layout.offsets == (0, 128, 256, 384, 512)
        out = tp_block_forward(block)
        per_rank.append(out)
    got = _assemble(per_rank, gathered=False)
    _compare({k: v for k, v in tp1_outputs.items() if k in got}, got, 8)


def test_fp8_rank_rows_crossing_a_checkpoint_block_are_split() -> None:
    """384 rows at tp 4: rank 1 keeps checkpoint rows 96..191, across scale blocks 0 and 1. Its rows are
    stored as two segments, each starting a physical block (rows 96..127 -> 0..31, 128..191 -> 128..191),
    so each physical block keeps one exact checkpoint scale; the output is unchanged."""
    w = torch.randn(384, 128)
    t = checkpoint_tensors("fp8", w)
    x = torch.randn(4, 128)
    ref = activation_reference("fp8", x) @ dequantized("fp8", t).t()
    outs = []
    for r in range(4):
        layer = ColumnParallelLinear(
            128, 384, tp=TPInfo(r, 4), scheme=Fp8PbWoScheme(), params_dtype=torch.float32
        )
        if r == 1:
            assert layer.weights.layout.segments == (Segment(0, 0, 32, 0), Segment(0, 32, 64, 128))
        load_shards(layer, [t], merged=False)
        layer.process_after_loading()
        if r == 1:
            assert tuple(layer.weight.shape) == (256, 128)
            assert int(torch.count_nonzero(layer.weight[32:128].view(torch.uint8))) == 0
        outs.append(layer(x))
    assert_close("fp8 split segments", ref, torch.cat(outs, -1), rtol=RTOL[torch.float32])


def test_fp8_row_parallel_needs_128_aligned_k_per_rank() -> None:
    with pytest.raises(ValueError, match="divisible by 128, got 64"):
        RowParallelLinear(512, 200, tp=TPInfo(0, 8), scheme=Fp8PbWoScheme())


def _gloo_worker(tp: TPInfo, path: str) -> dict[str, torch.Tensor]:
    block = TPBlock(tp)
    load_checkpoint(block, path, tp_block_mapping, tp=tp, progress=False)
    return tp_block_forward(block)


@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_collectives_match_tp1(tp: int, ckpt_path: Path, tp1_outputs: dict[str, torch.Tensor]) -> None:
    """Real process groups: gathered column outputs and all-reduced row outputs equal tp 1 on every rank."""
    per_rank = spawn_gloo(_gloo_worker, tp, str(ckpt_path))
    _compare(tp1_outputs, _assemble(per_rank, gathered=True), tp)


_TORCHRUN_SCRIPT = """
import json, sys, torch
from k3run.distributed import all_gather, all_reduce, exit_rank, init_distributed, shutdown_distributed
from k3run.layers.linear import RowParallelLinear
from k3run.quant.schemes import UnquantizedScheme

tp = init_distributed("gloo" if sys.argv[1] == "cpu" else None)
dev = torch.device("cuda", torch.cuda.current_device()) if sys.argv[1] == "cuda" else torch.device("cpu")
summed = all_reduce(torch.tensor([tp.rank + 1.0], device=dev), tp)
gathered = all_gather(torch.full((1, 2), float(tp.rank), device=dev), tp, dim=-1)
gen = torch.Generator().manual_seed(0)
w, x = torch.randn(24, 256, generator=gen), torch.randn(3, 256, generator=gen)
with dev:
    layer = RowParallelLinear(256, 24, tp=tp, input_is_parallel=False, scheme=UnquantizedScheme(),
                              params_dtype=torch.float32)
layer.weight.weight_loader(layer.weight, w)
err = (layer(x.to(dev)).cpu() - x @ w.t()).abs().max().item()
out = {"rank": tp.rank, "size": tp.size, "sum": summed.item(), "gathered": gathered.flatten().tolist()}
print(json.dumps(out | {"err": err}), flush=True)
if shutdown_distributed():
    exit_rank(0)  # no interpreter finalization: a gloo rank can abort there (k3run.distributed.exit_rank)
"""


def run_torchrun_like(world: int, device: str) -> list[dict]:
    """Start `world` processes with the environment torchrun sets (port chosen by the OS)."""
    import subprocess
    import sys

    port = free_port()
    procs = []
    for r in range(world):
        env = torchrun_env(r, world, port)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TORCHRUN_SCRIPT, device],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def check_torchrun_outputs(outs: list[dict], world: int) -> None:
    for r, o in enumerate(outs):
        assert (o["rank"], o["size"]) == (r, world)
        assert o["sum"] == world * (world + 1) / 2
        assert o["gathered"] == [float(i) for i in range(world) for _ in range(2)]
        # fp32 row-parallel partial sums vs one fp32 matmul (K = 256, |y| ~ 16): a few ulps of 2^-19
        assert o["err"] < 1e-4


def test_init_distributed_from_torchrun_env_gloo() -> None:
    check_torchrun_outputs(run_torchrun_like(2, "cpu"), 2)


@pytest.mark.gpu
def test_init_distributed_from_torchrun_env_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_torchrun_outputs(run_torchrun_like(2, "cuda"), 2)


def test_init_distributed_rejects_unknown_backend(monkeypatch) -> None:
    from k3run.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("K3RUN_DIST_BACKEND", "mpi")
    reset_knobs()
    with pytest.raises(ValueError, match="'nccl' or 'gloo', got 'mpi'"):
        init_distributed()
