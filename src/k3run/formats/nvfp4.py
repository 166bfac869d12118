"""NVFP4: packed E2M1 codes, one FP8 E4M3 scale per 16 elements, one fp32 global scale per tensor.

Reproduces NVIDIA ModelOpt's export byte for byte (checked against real exports in tests/fixtures):
  weight_scale_2 = amax(|W|) / (6 * 448)
  weight_scale   = fp8_e4m3(clamp(amax_blk / (6 * weight_scale_2), 2^-9, 448)), all-zero block -> 1.0
  q              = RNE_E2M1(W_fp32 / (fp32(weight_scale) * weight_scale_2))
and dequantizes W = E2M1[q] * weight_scale * weight_scale_2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3run.formats._checks import check_divisible, check_dtype, check_float, check_min_dims, check_shape
from k3run.formats._ops import div_exact
from k3run.formats.e2m1 import E2M1_MAX, decode_e2m1_bytes, e2m1_decode, e2m1_encode, pack_e2m1

NVFP4_GROUP = 16
FP8_E4M3_MAX = 448.0
# smallest E4M3 subnormal: block scales are clamped to it so that no non-zero block gets scale 0
_MIN_BLOCK_SCALE = 2.0**-9


class NvFp4Tensor(NamedTuple):
    """One NVFP4 weight as ModelOpt stores it (leading batch dims, e.g. experts, are allowed)."""

    weight: torch.Tensor  # uint8 [..., N, K/2], element 2j in the low nibble
    weight_scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    weight_scale_2: torch.Tensor  # fp32, 0-dim (or [...] for batched input), decode multiplier


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Global (decode) scale amax / (6 * 448) as fp32, the formula of weight_scale_2 and input_scale.

    A zero amax is replaced by 6 (ModelOpt's export substitutes the format maximum for a zero amax), so
    an all-zero tensor gets a positive scale instead of dividing by zero.
    """
    a = torch.as_tensor(amax).float()
    if a.numel() and not bool((torch.isfinite(a) & (a >= 0)).all()):
        raise ValueError(f"nvfp4_global_scale amax: expected finite values >= 0, got {a.tolist()}")
    a = torch.where(a == 0, torch.full_like(a, E2M1_MAX), a)
    return div_exact(a, E2M1_MAX * FP8_E4M3_MAX)


def _as_global_scale(name: str, scale: torch.Tensor | float, lead: tuple[int, ...]) -> torch.Tensor:
    """Validate a global scale: positive finite fp32, 0-dim/one element or one per leading index."""
    s = torch.as_tensor(scale)
    if s.is_floating_point() and s.dtype != torch.float32:
        s = s.float()
    check_dtype(name, s, (torch.float32,))
    if s.numel() == 1:
        s = s.reshape(())
    elif tuple(s.shape) != lead:
        raise ValueError(f"{name}: expected a scalar or shape {lead}, got shape {tuple(s.shape)}")
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"{name}: expected positive finite values, got {s.flatten()[:8].tolist()}")
    return s


def nvfp4_quantize_blocks(
    blocks: torch.Tensor, weight_scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks [..., G, 16] and a global scale broadcastable against the block amaxes [..., G] ->
    (codes uint8 [..., G, 16], block scales float8_e4m3fn [..., G]). No validation: callers check inputs."""
    amax_blk = blocks.abs().amax(dim=-1)
    per_block = amax_blk / (E2M1_MAX * weight_scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    block_scale = per_block.clamp(min=_MIN_BLOCK_SCALE, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    # the divisor is formed first, in fp32, as ModelOpt does; dividing twice would round differently
    divisor = block_scale.float() * weight_scale_2
    codes = e2m1_encode(blocks / divisor.unsqueeze(-1))
    return codes, block_scale


def quantize_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | float | None = None) -> NvFp4Tensor:
    """Quantize a weight [..., N, K] (K % 16 == 0) to NVFP4 exactly as ModelOpt exports it.

    weight_scale_2: the decode global scale to use; None computes amax(|W|)/2688 per [N, K] matrix. Pass
    a shared value for layers an engine fuses (ModelOpt uses max of the amaxes over q/k/v and gate/up).
    """
    check_float("quantize_nvfp4 w", w)
    check_min_dims("quantize_nvfp4 w", w, 2)
    check_divisible("quantize_nvfp4 w", w.shape[-1], NVFP4_GROUP, "K (last dim)")
    lead = tuple(w.shape[:-2])
    wf = w.float()
    if weight_scale_2 is None:
        wsc2 = nvfp4_global_scale(wf.abs().amax(dim=(-2, -1)))
    else:
        wsc2 = _as_global_scale("quantize_nvfp4 weight_scale_2", weight_scale_2, lead).to(w.device)
    n, k = w.shape[-2], w.shape[-1]
    blocks = wf.reshape(*lead, n, k // NVFP4_GROUP, NVFP4_GROUP)  # [..., N, K/16, 16]
    codes, block_scale = nvfp4_quantize_blocks(blocks, wsc2.reshape(*wsc2.shape, 1, 1))
    packed = pack_e2m1(codes.reshape(*lead, n, k))
    return NvFp4Tensor(weight=packed, weight_scale=block_scale, weight_scale_2=wsc2.clone())


def dequantize_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 [..., N, K/2], fp8 [..., N, K/16], fp32 scalar (or [...]) -> W [..., N, K] in `dtype`.

    E2M1 value times an E4M3 scale is exact in fp32, so the only rounding is the final multiply by the
    global scale (and the cast to `dtype`).
    """
    check_dtype("dequantize_nvfp4 weight", weight, (torch.uint8,))
    check_dtype("dequantize_nvfp4 weight_scale", weight_scale, (torch.float8_e4m3fn,))
    check_min_dims("dequantize_nvfp4 weight", weight, 2)
    check_divisible("dequantize_nvfp4 weight", weight.shape[-1], NVFP4_GROUP // 2, "packed width K/2")
    n, k = weight.shape[-2], weight.shape[-1] * 2
    lead = tuple(weight.shape[:-2])
    check_shape("dequantize_nvfp4 weight_scale", weight_scale, (*lead, n, k // NVFP4_GROUP))
    wsc2 = _as_global_scale("dequantize_nvfp4 weight_scale_2", weight_scale_2, lead).to(weight.device)
    vals = decode_e2m1_bytes(weight).reshape(*lead, n, k // NVFP4_GROUP, NVFP4_GROUP)
    scaled = vals * weight_scale.float().unsqueeze(-1)
    out = scaled * wsc2.reshape(*wsc2.shape, 1, 1, 1)
    return out.reshape(*lead, n, k).to(dtype)


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize-dequantize activations x [..., K] through NVFP4 (W4A4 emulation); returns x's dtype.

    global_scale is the decode scale (the checkpoint's input_scale); the encode scale is s = 1/global_scale.
    Per 16-block: bs = fp8(min(s * amax_blk / 6, 448)), q = RNE_E2M1(clamp(x * s / bs, -6, 6)),
    x_hat = q * bs * global_scale. A block whose scale underflows to 0 in fp8 dequantizes to 0.
    """
    check_float("nvfp4_qdq x", x)
    check_min_dims("nvfp4_qdq x", x, 1)
    check_divisible("nvfp4_qdq x", x.shape[-1], NVFP4_GROUP, "K (last dim)")
    gs = _as_global_scale("nvfp4_qdq global_scale", global_scale, ()).to(x.device)
    enc = torch.ones_like(gs) / gs
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)  # [..., K/16, 16]
    amax_blk = blocks.abs().amax(dim=-1, keepdim=True)
    bs = div_exact(enc * amax_blk, E2M1_MAX).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    safe_bs = torch.where(bs == 0, torch.ones_like(bs), bs)
    scaled = (blocks * enc / safe_bs).clamp(-E2M1_MAX, E2M1_MAX)
    x_hat = e2m1_decode(e2m1_encode(scaled)) * bs * gs
    return x_hat.reshape(x.shape).to(x.dtype)
