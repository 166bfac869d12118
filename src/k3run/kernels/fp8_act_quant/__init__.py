"""Dynamic per-token 1x128 FP8 activation quantization: Triton on CUDA, the formats reference elsewhere."""

from __future__ import annotations

import torch

from .ref import fp8_act_quant_ref


def quantize_act_1x128(
    x: torch.Tensor, *, m_multiple: int = 1, scale_outer_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M', K], scale fp32 [M', K/128]), M' = M rounded up to m_multiple.

    scale_outer_major lays the scale out with strides (1, M') (what block-wise torch._scaled_mm wants).
    Both implementations give bit-identical results.
    """
    if x.is_cuda:
        from .triton import fp8_act_quant

        return fp8_act_quant(x, m_multiple=m_multiple, scale_outer_major=scale_outer_major)
    q, scale = fp8_act_quant_ref(x, m_multiple)
    if scale_outer_major:
        scale = scale.t().contiguous().t()
    return q, scale


__all__ = ["fp8_act_quant_ref", "quantize_act_1x128"]
