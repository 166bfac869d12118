"""Model building blocks: parallel linears (linear.py), activations, norms, KDA, MLA, MoE."""

from __future__ import annotations
