"""Model definitions (Kimi Linear and Kimi K3)."""

from __future__ import annotations

from k3run.models.kimi import CHECKPOINT_TABLE, KimiForCausalLM, map_checkpoint_name

__all__ = ["CHECKPOINT_TABLE", "KimiForCausalLM", "map_checkpoint_name"]
