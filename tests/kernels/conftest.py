"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from k3run.kernels import cpu_fused


@pytest.fixture
def fused_everywhere(monkeypatch):
    """The CPU's compiled loops at any size (the default threshold keeps test-sized matrices on the
    references; the AVX-512 extension, which would take the decode rows first, is off: it has its own
    tests)."""
    monkeypatch.setattr(cpu_fused, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(cpu_fused, "disabled", None)
    monkeypatch.setenv("K3RUN_CPU_AVX512", "0")
