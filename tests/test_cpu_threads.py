"""The CPU intra-op thread choice: by the model's largest matrix, with the overrides in their order."""

from __future__ import annotations

import pytest
import torch

from k3run.cpu_threads import choose_cpu_threads, largest_matrix, set_cpu_threads
from k3run.kernels.cpu_fused import MIN_WEIGHTS
from k3run.knobs import reset_knobs


def _model(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    m = torch.nn.Module()
    m.embed_tokens = torch.nn.Parameter(torch.zeros(4096, 1024), requires_grad=False)  # left out
    m.proj = torch.nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)
    m.norm = torch.nn.Parameter(torch.zeros(cols), requires_grad=False)
    return m


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("K3RUN_CPU_THREADS", raising=False)
    reset_knobs()


def test_small_matrices_run_on_one_thread(no_env):
    n, why = choose_cpu_threads(_model(128, 384))
    assert n == 1 and "proj" in why and "49,152" in why


def test_large_matrices_keep_every_core(no_env):
    n, why = choose_cpu_threads(_model(1024, 1024))
    assert n == torch.get_num_threads() and "every core" in why


def test_nvfp4_bytes_count_two_weights_each(no_env):
    # a packed NVFP4 [N, K/2] uint8 matrix holds N x K weights: 1024 x 512 bytes is exactly MIN_WEIGHTS
    assert largest_matrix(_model(1024, 512, torch.uint8)) == ("proj", MIN_WEIGHTS)
    assert choose_cpu_threads(_model(1024, 511, torch.uint8))[0] == 1


def test_overrides_in_order(no_env, monkeypatch):
    m = _model(128, 384)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_cpu_threads(m)[1] == "$OMP_NUM_THREADS"
    monkeypatch.setenv("K3RUN_CPU_THREADS", "3")
    reset_knobs()
    assert choose_cpu_threads(m) == (3, "$K3RUN_CPU_THREADS")
    assert choose_cpu_threads(m, threads=2) == (2, "--threads")
    monkeypatch.setenv("K3RUN_CPU_THREADS", "two")
    reset_knobs()
    with pytest.raises(ValueError, match=r"K3RUN_CPU_THREADS: expected a positive integer, got 'two'"):
        choose_cpu_threads(m)


def test_set_applies_and_says_why(no_env):
    before = torch.get_num_threads()
    try:
        line = set_cpu_threads(_model(128, 384))
        assert torch.get_num_threads() == 1 and line.startswith("CPU: 1 intra-op thread (")
    finally:
        torch.set_num_threads(before)
