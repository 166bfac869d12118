from __future__ import annotations

import atexit
import os
import sys

import pytest
import torch

from k3run.knobs import reset_knobs
from k3run.testing import assert_close, nan_poisoned_empty

__all__ = ["assert_close"]

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def poison_empty():
    """Kernel tests: outputs allocated with torch.empty start as NaN (floats) or 0xFF (uint8)."""
    with nan_poisoned_empty():
        yield


@pytest.fixture(scope="session")
def model():
    """The bundled k3-mixed model in fp32, loaded once per session for the server, tool-call and
    structured-output tests (a module that needs another model defines its own `model`)."""
    from k3run.api import load_model
    from k3run.cli import default_model_dir

    d = default_model_dir()
    if d is None:
        pytest.skip("no bundled model")
    return load_model(d, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _knobs_from_environment():
    """Every test parses the K3RUN_* variables afresh, and no test's changes outlive it: a test that sets one
    calls reset_knobs() after monkeypatch.setenv (this fixture's teardown runs after monkeypatch's undo)."""
    reset_knobs()
    yield
    reset_knobs()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


os.environ.setdefault("OMP_NUM_THREADS", "2")


def _silence_stderr() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def pytest_unconfigure(config):
    # libtriton's nanobind bindings print a "leaked instances/types/functions" report to stderr while the
    # interpreter tears its modules down (triton silences the same report in its own worker processes). The
    # test summary has been written by now; the handler runs after it, just before that teardown.
    if "triton" in sys.modules:
        atexit.register(_silence_stderr)
