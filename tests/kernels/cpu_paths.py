"""Skip markers shared by the CPU quantized-linear tests (test_nvfp4_cpu.py, test_fp8_cpu.py)."""

from __future__ import annotations

import shutil

import pytest

import k3run.kernels.cpu_avx512 as cpu_avx512

# torch.compile's CPU backend builds C++: without a compiler the references run (tested by faking the failure)
needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler for torch.compile"
)
needs_avx512 = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++")) or not cpu_avx512.cpu_supported(),
    reason="the AVX-512 extension needs an AVX-512 CPU and a C++ compiler",
)
