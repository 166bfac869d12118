"""E2M1 (FP4) codes: encode with round-to-nearest-even, decode, and nibble packing.

Code layout: bit 3 is the sign, bits 0-2 index the magnitude grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
Packed bytes hold logical element 2j in the LOW nibble and 2j+1 in the HIGH nibble (ModelOpt, vLLM).
"""

from __future__ import annotations

import torch

from k3run.formats._checks import check_dtype, check_float

E2M1_MAX = 6.0

# code -> value; code 8 is -0.0 (ModelOpt writes it for tiny negatives, see e2m1_encode)
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between neighbouring grid values. A tie goes to the neighbour with an even mantissa:
# the midpoints 0.75, 1.75 and 3.5 round up (to 1, 2, 4), while 0.25, 1.25, 2.5 and 5 round down.
_MIDPOINTS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_MIDPOINTS_TIE_UP = (0.75, 1.75, 3.5)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round a finite float tensor onto the E2M1 grid, saturating at +-6; returns uint8 codes of x's shape.

    The sign bit comes from `x < 0` before rounding, so a small negative value that rounds to 0 gives
    code 8 (-0), bit-identical to ModelOpt's exporter; -0.0 itself gives code 0.
    """
    check_float("e2m1_encode input", x)
    a = x.abs().float()
    # magnitude code = number of midpoints that `a` has passed; the strictness of each comparison
    # encodes the tie direction
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for m in _MIDPOINTS_TIE_DOWN:
        mag += (a > m).to(torch.uint8)
    for m in _MIDPOINTS_TIE_UP:
        mag += (a >= m).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return sign | mag


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) -> fp32 values of the same shape."""
    check_dtype("e2m1_decode codes", codes, (torch.uint8,))
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"e2m1_decode codes: expected values in 0..15, got max {int(codes.max())}")
    return E2M1_VALUES.to(codes.device)[codes.long()]


# every byte's two values: row b = (value of the low nibble, value of the high nibble)
_BYTE_VALUES: dict[torch.device, torch.Tensor] = {}


def decode_e2m1_bytes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., K/2] -> fp32 values [..., K], low nibble first: `e2m1_decode(unpack_e2m1(packed))` by
    one 256-entry table lookup (every byte is a valid pair of codes, so nothing needs checking)."""
    check_dtype("decode_e2m1_bytes packed", packed, (torch.uint8,))
    if packed.dim() == 0:
        raise ValueError("decode_e2m1_bytes packed: expected at least 1 dim, got a 0-dim tensor")
    table = _BYTE_VALUES.get(packed.device)
    if table is None:
        b = torch.arange(256, dtype=torch.int64)
        table = torch.stack((E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]), dim=-1).to(packed.device)  # [256, 2]
        _BYTE_VALUES[packed.device] = table
    return table[packed.long()].reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> uint8 bytes [..., K/2] with element 2j in the low nibble."""
    check_dtype("pack_e2m1 codes", codes, (torch.uint8,))
    if codes.dim() == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_e2m1 codes: last dim must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_e2m1 codes: expected values in 0..15, got max {int(codes.max())}")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., K/2] -> uint8 codes [..., K] (inverse of pack_e2m1)."""
    check_dtype("unpack_e2m1 packed", packed, (torch.uint8,))
    if packed.dim() == 0:
        raise ValueError("unpack_e2m1 packed: expected at least 1 dim, got a 0-dim tensor")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
