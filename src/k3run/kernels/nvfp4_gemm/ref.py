"""fp32 reference for the NVFP4 W4A16 linear: dequantize with k3run.formats, then an fp32 matmul."""

from __future__ import annotations

import torch

from k3run.formats import dequantize_nvfp4


def nvfp4_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (e2m1(weight) * weight_scale * global_scale)^T + bias, computed in fp32.

    weight: uint8 [N, K/2]; weight_scale: float8_e4m3fn [N, K/16]; global_scale: fp32, one element or one per
    output row (fused shards with different global scales). The result is returned in x's dtype.
    """
    one = torch.ones((), dtype=torch.float32, device=weight.device)
    w = dequantize_nvfp4(weight, weight_scale, one, dtype=torch.float32)  # [N, K]
    w = w * global_scale.to(torch.float32).reshape(-1, 1)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
