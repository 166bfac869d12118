"""bench/probes/chain_latency.py's kernels on the CPU: the launch chain and the weight stream in the Triton
interpreter (every stage's value counted, each program's share of the words summed), and the persistent
form compiled for sm_90 (its grid barrier: a release add after the CTA barrier, an acquire spin, the
producer's value read from L2). The persistent form cannot run in the interpreter, which runs programs one
after another: the first would spin on a barrier the others never reach. Its timing and its own end-to-end
check (every final value N) run on a GPU."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.interpreter_utils import interp_only, run_interp_tests_in_child

triton = pytest.importorskip("triton")


def _probe() -> ModuleType:
    key = "k3run_probe_chain_latency"
    if key not in sys.modules:
        path = Path(__file__).parents[1] / "bench" / "probes" / "chain_latency.py"
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def test_chain_latency_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=3)


@interp_only
@pytest.mark.parametrize("share", [0, 48])
def test_interp_plain_chain_counts_every_stage(share: int) -> None:
    """6 stages of 5 programs from zeros: every value ends at 6, and each row s holds s (a stage that read
    its producer's row before it was written would leave a smaller count)."""
    probe = _probe()
    n, g = 6, 5
    buf = torch.zeros(n + 1, g, dtype=torch.int32)
    w = torch.randint(-(2**30), 2**30, (max(n * g * share, 1),), dtype=torch.int32)
    probe.chain("plain", buf, w, torch.zeros(1, dtype=torch.int32), share, block=16)
    assert torch.equal(buf, torch.arange(n + 1, dtype=torch.int32)[:, None].expand(n + 1, g))


@interp_only
def test_interp_stream_sums_each_programs_share() -> None:
    """The floor kernel with zero = 1 stores each program's wrapped int32 sum of its share: 7 programs of 48
    words in steps of 16; and share_for rounds a stage's KB up to whole steps a program."""
    probe = _probe()
    share, g = 48, 7
    w = torch.randint(-(2**30), 2**30, (g * share,), dtype=torch.int32)
    out = torch.empty(g, dtype=torch.int32)
    probe._floor_kernel[(g,)](w, out, share, 1, BLOCK=16)
    want = [int(w[p * share : (p + 1) * share].long().sum()) for p in range(g)]
    want = [(v + 2**31) % 2**32 - 2**31 for v in want]  # int32 wrap-around
    assert out.tolist() == want
    assert probe.share_for(1024, 132, 2048) == 2048 and probe.share_for(1057, 132, 1024) == 3072
    assert probe.share_for(0, 132) == 0


def test_persistent_chain_compiles_with_its_grid_barrier_for_sm90() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    probe = _probe()
    sig = {"buf_ptr": "*i32", "w_ptr": "*i32", "cnt_ptr": "*i32", "BLOCK": "constexpr"}
    sig |= {name: "i32" for name in ("N", "share", "zero", "G")}
    src = ASTSource(probe._persist_kernel, sig, {"BLOCK": probe.BLOCK})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    body = ptx.split(".entry", 1)[1]
    arrive = re.search(r"(red|atom)\.global\.(gpu\.release|release\.gpu)\.add", body)
    spin = re.search(r"(ld|atom)\.global\.(gpu\.acquire|acquire\.gpu)", body)
    assert arrive and spin, "no release arrival or acquire spin"
    assert "bar.sync" in body[: arrive.start()], "no CTA barrier before the arrival"
    assert "ld.global.cg" in body, "the producer's value is not read from L2"
