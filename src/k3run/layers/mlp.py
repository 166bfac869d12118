"""The gated MLP of Kimi models (dense layer-0 MLP and the shared experts), tensor parallel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from k3run.distributed import NO_TP, TPInfo
from k3run.layers.activation import GatedActivation
from k3run.layers.linear import MergedColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from k3run.quant.modelopt import QuantConfig


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x), up_proj(x))): gate/up fused column-parallel (rank-local [gate | up]),
    down row-parallel with its all-reduce. Checkpoint gate_proj / up_proj are shards 0 / 1 of gate_up_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: GatedActivation,
        *,
        qcfg: QuantConfig | None = None,
        prefix: str = "mlp",
        tp: TPInfo = NO_TP,
        params_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            qcfg=qcfg,
            prefix=f"{prefix}.gate_up_proj",
            shard_prefixes=[f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            tp=tp,
            params_dtype=params_dtype,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            qcfg=qcfg,
            prefix=f"{prefix}.down_proj",
            tp=tp,
            params_dtype=params_dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_up_proj(x)))  # [T, 2I/tp] -> [T, I/tp] -> [T, D]
