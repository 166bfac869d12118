"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from k3run.kernels import cpu_fused, cpu_simd
from k3run.knobs import reset_knobs


@pytest.fixture
def fused_everywhere(monkeypatch):
    """The CPU's compiled loops at any size (the default threshold keeps test-sized matrices on the
    references; the SIMD extension, which would take the decode rows first, is off: it has its own
    tests)."""
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(cpu_fused, "disabled", None)
    monkeypatch.setenv("K3RUN_CPU_SIMD", "0")
    reset_knobs()


@pytest.fixture(params=["avx512", "avx2"])
def simd_level(request, monkeypatch) -> str:
    """The SIMD extension at one instruction set: AVX-512 where the CPU has it, and AVX2 on any AVX2 or
    AVX-512 CPU (K3RUN_CPU_SIMD=avx2), so an AVX-512 machine tests both."""
    monkeypatch.delenv("K3RUN_CPU_SIMD", raising=False)
    reset_knobs()
    native = cpu_simd.cpu_level()
    if native is None or (request.param == "avx512" and native != "avx512"):
        pytest.skip(f"this CPU runs {native or 'neither AVX2 nor AVX-512'}")
    if request.param == "avx2":
        monkeypatch.setenv("K3RUN_CPU_SIMD", "avx2")
        reset_knobs()
    assert cpu_simd.cpu_level() == request.param
    return request.param
