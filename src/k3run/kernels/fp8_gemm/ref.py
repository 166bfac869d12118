"""fp32 reference for the FP8_PB_WO linear (1x128 dynamic activation groups x 128x128 weight tiles)."""

from __future__ import annotations

import torch

from k3run.formats import dequantize_fp8_act_1x128, dequantize_fp8_block, quantize_fp8_act_1x128


def fp8_block_gemm_ref(
    q_x: torch.Tensor, scale_x: torch.Tensor, q_w: torch.Tensor, scale_w: torch.Tensor
) -> torch.Tensor:
    """fp32 y [M, N] = sum_kb (q_x * s_x[m, kb]) (q_w * s_w[nb, kb])^T; scale_w [N/128, K/128] (or 4-D)."""
    return dequantize_fp8_act_1x128(q_x, scale_x) @ dequantize_fp8_block(q_w, scale_w).t()


def fp8_pb_wo_linear_ref(
    x: torch.Tensor,
    weight_padded: torch.Tensor,
    scale_2d: torch.Tensor,
    n_logical: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] quantized per token and 128 columns, times the padded block weight, cropped to n_logical
    columns, plus bias; fp32 math, returned in x's dtype."""
    q_x, scale_x = quantize_fp8_act_1x128(x)
    y = fp8_block_gemm_ref(q_x, scale_x, weight_padded, scale_2d)[:, :n_logical]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
