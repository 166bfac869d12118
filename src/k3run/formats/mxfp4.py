"""MXFP4 (E2M1 codes, one E8M0 power-of-two scale per 32 elements) and its lossless cast to NVFP4.

The K3 converter keeps the E2M1 codes and rewrites the scales: with k_j the unbiased exponent of
block j and m = k_max - 8, weight_scale_2 = 2^m and each 32-block scale 2^k_j becomes two 16-block
scales 2^(k_j - m) in [2^-9, 2^8], all exact in E4M3. A block with k_max - k_j > 17 cannot be
represented; it is re-quantized from its values with the NVFP4 block formula (lossy, and tiny anyway:
its magnitude is below 6 * 2^(k_max - 18)).
"""

from __future__ import annotations

import math

import torch

from k3run.formats._checks import check_divisible, check_dtype, check_min_dims, check_shape
from k3run.formats.e2m1 import e2m1_decode, pack_e2m1, unpack_e2m1
from k3run.formats.nvfp4 import NVFP4_GROUP, NvFp4Tensor, nvfp4_quantize_blocks

MXFP4_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# block scales 2^(k_j - m) with m = k_max - 8 span [2^-9, 2^8]; 2^-9 is the smallest E4M3 subnormal
_MAX_EXPONENT_GAP = 17
_SCALE_HEADROOM = 8


def e8m0_to_float(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> fp32 2^(e - 127), built from the bit pattern so it is exact (e = 0 is
    the fp32 subnormal 2^-127). e = 255 is NaN in E8M0 and rejected."""
    check_dtype("e8m0 scale", scale_e8m0, (torch.uint8,))
    if scale_e8m0.numel() and int(scale_e8m0.max()) == E8M0_NAN:
        raise ValueError("e8m0 scale: expected exponents 0..254, got 255 (the E8M0 NaN encoding)")
    e = scale_e8m0.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def _check_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor, fn: str) -> tuple[int, int]:
    check_dtype(f"{fn} packed", packed, (torch.uint8,))
    check_dtype(f"{fn} scale_e8m0", scale_e8m0, (torch.uint8,))
    check_min_dims(f"{fn} packed", packed, 2)
    check_divisible(f"{fn} packed", packed.shape[-1], MXFP4_GROUP // 2, "packed width K/2")
    n, k = packed.shape[-2], packed.shape[-1] * 2
    check_shape(f"{fn} scale_e8m0", scale_e8m0, (*packed.shape[:-2], n, k // MXFP4_GROUP))
    return n, k


def dequantize_mxfp4(
    packed: torch.Tensor, scale_e8m0: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [..., N, K/2] (low nibble = even k) and uint8 E8M0 [..., N, K/32] -> W [..., N, K]."""
    n, k = _check_mxfp4(packed, scale_e8m0, "dequantize_mxfp4")
    lead = tuple(packed.shape[:-2])
    vals = e2m1_decode(unpack_e2m1(packed)).reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    out = vals * e8m0_to_float(scale_e8m0).unsqueeze(-1)
    return out.reshape(*lead, n, k).to(dtype)


def mxfp4_k_max(scale_e8m0: torch.Tensor) -> int:
    """Largest unbiased exponent of an E8M0 scale tensor (take the max of w1's and w3's to share it)."""
    check_dtype("mxfp4_k_max scale_e8m0", scale_e8m0, (torch.uint8,))
    if scale_e8m0.numel() == 0:
        raise ValueError("mxfp4_k_max scale_e8m0: expected a non-empty tensor, got 0 elements")
    return int(scale_e8m0.max()) - E8M0_BIAS


def mxfp4_to_nvfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor, k_max: int | None = None) -> NvFp4Tensor:
    """MXFP4 [N, K/2] + E8M0 [N, K/32] -> NVFP4 with the same codes (K3 converter).

    k_max: unbiased exponent defining weight_scale_2 = 2^(k_max - 8); None uses this tensor's largest.
    Pass max(mxfp4_k_max(w1 scale), mxfp4_k_max(w3 scale)) so gate and up of one expert share it.
    """
    n, k = _check_mxfp4(packed, scale_e8m0, "mxfp4_to_nvfp4")
    if packed.dim() != 2:
        raise ValueError(f"mxfp4_to_nvfp4 packed: expected 2 dims [N, K/2], got shape {tuple(packed.shape)}")
    own_max = mxfp4_k_max(scale_e8m0)
    if k_max is None:
        k_max = own_max
    elif k_max < own_max:
        raise ValueError(
            f"mxfp4_to_nvfp4 k_max: expected >= the tensor's largest exponent {own_max}, got {k_max}"
        )
    e8m0_to_float(scale_e8m0)  # rejects the NaN exponent
    m = k_max - _SCALE_HEADROOM
    if not -126 <= m <= 127:
        raise ValueError(
            f"mxfp4_to_nvfp4 k_max: 2^(k_max - 8) must be a normal fp32 number, got k_max={k_max}"
        )
    wsc2 = torch.tensor(math.ldexp(1.0, m), dtype=torch.float32, device=packed.device)

    gap = k_max - (scale_e8m0.to(torch.int32) - E8M0_BIAS)  # [N, K/32]
    exact = gap <= _MAX_EXPONENT_GAP
    exp16 = (_SCALE_HEADROOM - gap).clamp(min=-9).repeat_interleave(2, dim=-1)  # [N, K/16]
    block_scale = torch.ldexp(torch.ones_like(exp16, dtype=torch.float32), exp16).to(torch.float8_e4m3fn)
    if bool(exact.all()):
        return NvFp4Tensor(weight=packed.clone(), weight_scale=block_scale, weight_scale_2=wsc2)

    values = dequantize_mxfp4(packed, scale_e8m0).reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    fb_codes, fb_scale = nvfp4_quantize_blocks(values, wsc2)
    exact16 = exact.repeat_interleave(2, dim=-1)  # [N, K/16]
    codes = unpack_e2m1(packed).reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    codes = torch.where(exact16.unsqueeze(-1), codes, fb_codes)
    block_scale = torch.where(exact16, block_scale.float(), fb_scale.float()).to(torch.float8_e4m3fn)
    return NvFp4Tensor(weight=pack_e2m1(codes.reshape(n, k)), weight_scale=block_scale, weight_scale_2=wsc2)
