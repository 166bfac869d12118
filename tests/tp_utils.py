"""Helpers shared by the linear / loader tests: checkpoint tensors per scheme, their exact dequantized
references, layers filled through their weight loaders, and simulated or spawned TP ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3run.distributed import TPInfo
from k3run.formats import (
    dequantize_fp8_act_1x128,
    dequantize_fp8_block,
    dequantize_nvfp4,
    nvfp4_qdq,
    quantize_fp8_act_1x128,
    quantize_fp8_block,
    quantize_nvfp4,
)
from k3run.quant.algo import QuantAlgo
from k3run.quant.schemes import Fp8PbWoScheme, LinearScheme, NvFp4Scheme, UnquantizedScheme

KINDS = ("none", "fp8", "nvfp4")


def make_scheme(kind: str, *, w4a4: bool = False) -> LinearScheme:
    if kind == "none":
        return UnquantizedScheme()
    if kind == "fp8":
        return Fp8PbWoScheme()
    if kind == "nvfp4":
        return NvFp4Scheme(QuantAlgo.NVFP4, w4a4=w4a4)
    raise ValueError(kind)


def checkpoint_tensors(
    kind: str, w: torch.Tensor, input_scale: float = 1.0, weight_scale_2: float | None = None
) -> dict[str, torch.Tensor]:
    """What a ModelOpt export holds for the fp32 weight `w` [N, K] under `kind` (names without prefix)."""
    if kind == "none":
        return {"weight": w.clone()}
    if kind == "fp8":
        q, s = quantize_fp8_block(w)
        return {"weight": q, "weight_scale": s}
    t = quantize_nvfp4(w, weight_scale_2)
    return {
        "weight": t.weight,
        "weight_scale": t.weight_scale,
        "weight_scale_2": t.weight_scale_2.reshape(()),
        "input_scale": torch.tensor(input_scale, dtype=torch.float32),
    }


def dequantized(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The exact fp32 weight the checkpoint tensors `t` stand for."""
    if kind == "none":
        return t["weight"].float()
    if kind == "fp8":
        return dequantize_fp8_block(t["weight"], t["weight_scale"])
    return dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])


def activation_reference(kind: str, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The activation each scheme's GEMM effectively multiplies, in fp32."""
    if kind == "fp8":
        return dequantize_fp8_act_1x128(*quantize_fp8_act_1x128(x))
    if input_scale is not None:
        return nvfp4_qdq(x.float(), input_scale)
    return x.float()


def load_shards(layer: torch.nn.Module, shards: Sequence[dict[str, torch.Tensor]], merged: bool) -> None:
    """Feed full checkpoint tensors to every parameter's weight loader (shard id = position if merged)."""
    for i, tensors in enumerate(shards):
        for name, t in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, t, i if merged else None)


def random_weight(gen: torch.Generator, n: int, k: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, k, generator=gen)


def ranks(size: int) -> list[TPInfo]:
    return [TPInfo(rank=r, size=size) for r in range(size)]
