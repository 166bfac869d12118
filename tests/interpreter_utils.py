"""Running a test file's `interp_` tests under the Triton interpreter in a child pytest process.

TRITON_INTERPRET is read by `@triton.jit` when a kernel module is imported, so setting it in the main test
process would leak into every other test module; the child gets it together with K3RUN_INTERP_CHILD=1, which
lifts the `interp_only` skip there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

IN_INTERP_CHILD = os.environ.get("K3RUN_INTERP_CHILD") == "1"
interp_only = pytest.mark.skipif(not IN_INTERP_CHILD, reason="runs in the TRITON_INTERPRET=1 child process")


def run_interp_tests_in_child(test_file: str, expected_passed: int) -> None:
    """Run `test_file`'s `interp_` tests with TRITON_INTERPRET=1; exactly `expected_passed` of them must pass
    and none may be skipped (a count that drifts means a test silently stopped running)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the compiled kernels are tested by the gpu tests instead")
    env = dict(os.environ, TRITON_INTERPRET="1", K3RUN_INTERP_CHILD="1")
    cmd = [sys.executable, "-m", "pytest", test_file, "-vv", "-x", "-k", "interp_", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count(" PASSED") == expected_passed and " SKIPPED" not in proc.stdout, proc.stdout[
        -3000:
    ]
