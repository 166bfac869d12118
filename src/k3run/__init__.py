"""k3run: run NVIDIA ModelOpt-quantized Kimi hybrid models (Kimi K3, Kimi Linear) on Hopper GPUs and CPUs."""

from __future__ import annotations

__version__ = "0.1.0"
