"""Telling a Triton that cannot build a kernel from a real error, for the paths that fall back to another
kernel when theirs does not build (the wgmma GEMMs, the expert_blocks kernels)."""

from __future__ import annotations

from triton.compiler.errors import CompilationError

# what a failed kernel build raises: a CompilationError from the frontend, or the RuntimeError a failed MLIR
# pass raises ("PassManager::run failed")
BUILD_ERRORS = (CompilationError, RuntimeError)


def triton_build_failed(err: BaseException) -> bool:
    """Whether err (one of BUILD_ERRORS) is a kernel build failure; any other RuntimeError must propagate."""
    return isinstance(err, CompilationError) or "PassManager" in str(err)
