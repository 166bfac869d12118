"""MXFP4 (E2M1 codes, one E8M0 power-of-two scale per 32 elements) and its exact cast to NVFP4.

The cast keeps the E2M1 codes and rewrites the scales. With k_j the unbiased exponent of 32-block j and
k_max the largest of the tensor, the global scale is weight_scale_2 = 2^m, m = max(k_max - 8, -126) (a
normal fp32 number), and each 32-block's scale 2^k_j becomes two 16-block E4M3 scales 2^(k_j - m). E4M3
holds the powers of two 2^-9 .. 2^8 exactly (2^-9 .. 2^-7 as subnormals, 448 is its largest value), so a
block with k_j - m >= -9 is exact with its codes unchanged: this is every block when k_max - k_min <= 17,
the case of real weights. A block further below (k_j - m = -9 - s, s >= 1) gets the scale 2^-9 and its
values v must become v * 2^-s, which E2M1 holds exactly only for some codes (all of them when the block is
zero, which is how such tiny blocks arise); its codes are rewritten where that is exact and the cast is
refused otherwise, naming the block. Values of 2^128 and above (E8M0 exponents 126 and 127 with large
codes) overflow fp32 and are refused too. So the cast is either exact or an error, never a silent rounding;
tests/formats/test_mxfp4.py checks it over every E8M0 exponent and every code.

The converter that wrote nvidia/Kimi-K3-NVFP4 uses m = k_max - 8 as well (with k_max shared by w1 and w3 of
an expert), but re-quantizes the blocks below 2^-9 from their values, which can round them.

Device math note: CUDA kernels may flush fp32 subnormals to zero; weights below 2^-126 (E8M0 exponents
below 1) then read as zero there, exactly as the MXFP4 values themselves would in fp32 GPU math.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from k3run.formats._checks import check_divisible, check_dtype, check_min_dims, check_shape
from k3run.formats.e2m1 import e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from k3run.formats.nvfp4 import NVFP4_GROUP, NvFp4Tensor

MXFP4_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# the E4M3 powers of two run from 2^-9 (smallest subnormal) to 2^8
_MIN_BLOCK_EXP = -9
_MAX_BLOCK_EXP = 8
_MIN_GLOBAL_EXP = -126  # smallest normal fp32 exponent
_OVERFLOW = 2.0**128  # fp32 values reach (2 - 2^-23) * 2^127


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
    """Largest unbiased exponent of an E8M0 scale tensor."""
    check_dtype("mxfp4_k_max scale_e8m0", scale_e8m0, (torch.uint8,))
    if scale_e8m0.numel() == 0:
        raise ValueError("mxfp4_k_max scale_e8m0: expected a non-empty tensor, got 0 elements")
    return int(scale_e8m0.max()) - E8M0_BIAS


class Mxfp4Scales(NamedTuple):
    """The NVFP4 scales of one MXFP4 tensor, from its E8M0 scales alone (`mxfp4_scales_to_nvfp4`)."""

    weight_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor  # fp32 0-dim, a power of two
    # None when every block keeps its codes (the case of real weights); else int32 [N, K/32] tensors: each
    # block's unbiased exponent k_j, its shift s (> 0 where its values must be divided by 2^s) and the mask
    # of blocks `mxfp4_codes_to_nvfp4` must look at (shifted, or large enough to overflow fp32)
    exponent: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    check: torch.Tensor | None = None

    @property
    def codes_unchanged(self) -> bool:
        """True when the codes carry over as they are (no block needs its codes checked)."""
        return self.check is None


def _pow2_e4m3_bytes(m: int, device: torch.device) -> torch.Tensor:
    """uint8 [256]: for each E8M0 byte e, the E4M3 byte of 2^clamp(e - 127 - m, -9, 8). Normal E4M3 2^x is
    (x + 7) << 3 for x >= -6; 2^-7, 2^-8, 2^-9 are the subnormals 4, 2, 1."""
    x = (torch.arange(256, dtype=torch.int32, device=device) - E8M0_BIAS - m).clamp(
        _MIN_BLOCK_EXP, _MAX_BLOCK_EXP
    )
    normal = (x + 7) << 3
    sub = torch.ones_like(x) << (x - _MIN_BLOCK_EXP).clamp(min=0, max=2)
    return torch.where(x >= -6, normal, sub).to(torch.uint8)


def mxfp4_scales_to_nvfp4(scale_e8m0: torch.Tensor, k_max: int | None = None) -> Mxfp4Scales:
    """E8M0 scales [N, K/32] -> the NVFP4 block scales and global scale of the same values (module doc).

    k_max: the exponent defining weight_scale_2 = 2^max(k_max - 8, -126); None uses this tensor's largest
    (pass a larger one to share one global scale between tensors, e.g. w1 and w3). One pass for the range,
    one table lookup per block; the per-block exponent tensors only where some block needs its codes.
    """
    check_dtype("mxfp4 scale_e8m0", scale_e8m0, (torch.uint8,))
    check_min_dims("mxfp4 scale_e8m0", scale_e8m0, 2)
    if scale_e8m0.numel() == 0:
        raise ValueError("mxfp4 scale_e8m0: expected a non-empty tensor, got 0 elements")
    lo, hi = (int(v) for v in torch.aminmax(scale_e8m0))
    if hi == E8M0_NAN:
        raise ValueError("e8m0 scale: expected exponents 0..254, got 255 (the E8M0 NaN encoding)")
    own_max = hi - E8M0_BIAS
    if k_max is None:
        k_max = own_max
    elif k_max < own_max:
        raise ValueError(f"mxfp4 k_max: expected >= the tensor's largest exponent {own_max}, got {k_max}")
    if k_max > E8M0_NAN - 1 - E8M0_BIAS:
        raise ValueError(f"mxfp4 k_max: expected <= 127 (the largest E8M0 exponent), got {k_max}")
    m = max(k_max - _MAX_BLOCK_EXP, _MIN_GLOBAL_EXP)
    wsc2 = torch.tensor(math.ldexp(1.0, m), dtype=torch.float32, device=scale_e8m0.device)
    table = _pow2_e4m3_bytes(m, scale_e8m0.device)
    blocks = torch.take(table, scale_e8m0.long())  # [N, K/32] E4M3 bytes
    block_scale = blocks.unsqueeze(-1).expand(*blocks.shape, 2).reshape(*blocks.shape[:-1], -1)
    block_scale = block_scale.view(torch.float8_e4m3fn)  # [N, K/16]: both 16-halves of a 32-block
    # codes need a look only below 2^-9 * 2^m, or at exponents 126 and 127 (large codes overflow fp32)
    if lo - E8M0_BIAS - m >= _MIN_BLOCK_EXP and hi - E8M0_BIAS < 126:
        return Mxfp4Scales(block_scale, wsc2)
    k = scale_e8m0.to(torch.int32) - E8M0_BIAS
    shift = (_MIN_BLOCK_EXP - (k - m)).clamp(min=0)
    return Mxfp4Scales(block_scale, wsc2, exponent=k, shift=shift, check=(shift > 0) | (k >= 126))


def mxfp4_codes_to_nvfp4(packed: torch.Tensor, scales: Mxfp4Scales, what: str = "mxfp4") -> torch.Tensor:
    """The NVFP4 codes [N, K/2] for MXFP4 codes `packed` under `scales`: the same bytes, except blocks with
    shift s > 0, whose values are divided by 2^s. ValueError (naming `what`, the block and the value) where
    that is not exact in E2M1, or where a value overflows fp32."""
    check_dtype(f"{what} packed", packed, (torch.uint8,))
    check_min_dims(f"{what} packed", packed, 2)
    n, k = packed.shape[-2], packed.shape[-1] * 2
    check_shape(f"{what} weight_scale", scales.weight_scale, (n, k // NVFP4_GROUP))
    if scales.check is None or scales.exponent is None or scales.shift is None:
        return packed
    rows, blocks = scales.check.nonzero(as_tuple=True)
    codes = unpack_e2m1(packed).reshape(n, k // MXFP4_GROUP, MXFP4_GROUP)
    picked = codes[rows, blocks]  # [B, 32]
    vals = e2m1_decode(picked)
    exp = scales.exponent[rows, blocks].unsqueeze(-1)  # [B, 1]
    shift = scales.shift[rows, blocks].unsqueeze(-1)

    def where(mask: torch.Tensor) -> tuple[int, int, str]:
        b, j = (int(i) for i in mask.nonzero()[0])
        value = f"{float(vals[b, j])} * 2^{int(exp[b, 0])}"
        return b, j, f"row {int(rows[b])}, 32-block {int(blocks[b])}: MXFP4 value {value}"

    over = vals.abs().double() * torch.pow(2.0, exp.double()) >= _OVERFLOW
    if bool(over.any()):
        raise ValueError(
            f"{what}: {where(over)[2]} is beyond fp32's range (< 2^128); no weight is that large"
        )
    # a nonzero E2M1 value divided by 2^s is below 0.5 for s >= 4: clamping s at 8 keeps every nonzero
    # target inexact (and above fp32's subnormals) while zeros stay zero
    target = torch.ldexp(vals, -shift.clamp(max=8))
    new = e2m1_encode(target)
    bad = e2m1_decode(new) != target
    if bool(bad.any()):
        b, _, at = where(bad)
        raise ValueError(
            f"{what}: {at} sits {int(shift[b, 0])} binades below 2^-9 * weight_scale_2, the smallest NVFP4 "
            f"block scale (weight_scale_2 = 2^{int(math.log2(scales.weight_scale_2.item()))} follows the "
            f"tensor's largest exponent), and has no exact E2M1 code there; refusing a lossy MXFP4 -> NVFP4 "
            f"cast ({int(bad.any(-1).sum())} such 32-blocks)"
        )
    codes[rows, blocks] = torch.where(shift > 0, new, picked)
    return pack_e2m1(codes.reshape(n, k))


def mxfp4_to_nvfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor, k_max: int | None = None) -> NvFp4Tensor:
    """MXFP4 [N, K/2] + E8M0 [N, K/32] -> NVFP4 of exactly the same values, or ValueError (module doc).

    k_max: see `mxfp4_scales_to_nvfp4` (e.g. max of w1's and w3's to share one weight_scale_2).
    """
    n, k = _check_mxfp4(packed, scale_e8m0, "mxfp4_to_nvfp4")
    if packed.dim() != 2:
        raise ValueError(f"mxfp4_to_nvfp4 packed: expected 2 dims [N, K/2], got shape {tuple(packed.shape)}")
    scales = mxfp4_scales_to_nvfp4(scale_e8m0, k_max)
    codes = mxfp4_codes_to_nvfp4(packed, scales, "mxfp4_to_nvfp4")
    return NvFp4Tensor(codes.clone(), scales.weight_scale, scales.weight_scale_2)
