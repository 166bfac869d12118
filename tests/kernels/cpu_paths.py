"""Skip markers shared by the CPU quantized-linear tests (test_nvfp4_cpu.py, test_fp8_cpu.py)."""

from __future__ import annotations

import shutil

import pytest

import k3run.kernels.cpu_simd as cpu_simd

# torch.compile's CPU backend builds C++: without a compiler the references run (tested by faking the failure)
needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="no C++ compiler for torch.compile"
)
needs_simd = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++")) or not cpu_simd.cpu_supported(),
    reason="the SIMD extension needs an AVX2 or AVX-512 CPU and a C++ compiler",
)
