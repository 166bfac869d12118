"""fp32 reference for dynamic per-token 1x128 FP8 activation quantization (k3run.formats is the oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3run.formats import quantize_fp8_act_1x128


def fp8_act_quant_ref(x: torch.Tensor, m_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M', K], scale fp32 [M', K/128]), M' = M rounded up to m_multiple.

    scale = max(amax_group, 1e-10) / 448 and q = clamp(x / scale, +-448) in RNE; the padding rows are zeros
    (so their scale is 1e-10 / 448 and their q is 0).
    """
    m_pad = -(-x.shape[0] // m_multiple) * m_multiple
    return quantize_fp8_act_1x128(F.pad(x.float(), (0, 0, 0, m_pad - x.shape[0])))
