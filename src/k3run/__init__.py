"""k3run: run NVIDIA ModelOpt-quantized Kimi hybrid models (Kimi K3, Kimi Linear) on Hopper GPUs and CPUs."""

from __future__ import annotations

from k3run.api import load_model

__version__ = "0.1.0"

__all__ = ["__version__", "load_model"]
