"""FP8 E4M3 block formats: 128x128 weight tiles (ModelOpt FP8_PB_WO) and 1x128 dynamic activation groups.

Weight (byte for byte what ModelOpt exports): zero-pad W to multiples of 128, per tile s = amax/448 in
fp32 (an all-zero tile gets s = 1.0: ModelOpt replaces a zero amax by 448 before dividing),
q = (W / s).to(e4m3), crop q to [N, K]; scale layout [ceil(N/128), 1, ceil(K/128), 1], W = q * s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3run.formats._checks import check_divisible, check_dtype, check_float, check_min_dims, check_shape
from k3run.formats._ops import div_exact

FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
# floor on the activation group amax so an all-zero group gets a finite scale (vLLM's dynamic quant)
ACT_AMAX_FLOOR = 1e-10


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_fp8_block(
    w: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q float8_e4m3fn [N, K], scale fp32 [ceil(N/128), 1, ceil(K/128), 1]).

    scale: tile scales to use instead of amax/448 (4-D, 2-D or 0-dim layout). ModelOpt needs this for
    single-tile layers that an engine fuses (q/k/v and their siblings reading the same input, gate/up):
    their per-tensor amax is unified to the max over the group before export, exactly like NVFP4's
    weight_scale_2, while multi-tile layers keep their own tile scales.
    """
    check_float("quantize_fp8_block w", w)
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block w: expected 2 dims [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK)
    padded = F.pad(w.float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    tiles = padded.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)
    if scale is None:
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True)  # [Nb, 1, Kb, 1]
        amax = torch.where(amax == 0, torch.full_like(amax, FP8_E4M3_MAX), amax)
        tile_scale = div_exact(amax, FP8_E4M3_MAX)
    else:
        tile_scale = _scale_2d("quantize_fp8_block scale", scale, nb, kb).to(w.device).reshape(nb, 1, kb, 1)
        if not bool((torch.isfinite(tile_scale) & (tile_scale > 0)).all()):
            bad = tile_scale.flatten()[:8].tolist()
            raise ValueError(f"quantize_fp8_block scale: expected positive finite values, got {bad}")
        tile_scale = tile_scale.clone()
    q = (tiles / tile_scale).to(torch.float8_e4m3fn).reshape(nb * FP8_BLOCK, kb * FP8_BLOCK)
    return q[:n, :k].contiguous(), tile_scale


def _scale_2d(name: str, scale: torch.Tensor, nb: int, kb: int) -> torch.Tensor:
    """Accept [Nb, 1, Kb, 1] (ModelOpt), [Nb, Kb] (vLLM after loading) or 0-dim (single tile)."""
    check_dtype(name, scale, (torch.float32,))
    if scale.dim() == 0:
        if (nb, kb) != (1, 1):
            raise ValueError(f"{name}: a 0-dim scale needs a single tile, got {nb}x{kb} tiles")
        return scale.reshape(1, 1)
    if scale.dim() == 4:
        check_shape(name, scale, (nb, 1, kb, 1))
        return scale.reshape(nb, kb)
    if scale.dim() == 2:
        check_shape(name, scale, (nb, kb))
        return scale
    raise ValueError(
        f"{name}: expected shape ({nb}, 1, {kb}, 1), ({nb}, {kb}) or (), got {tuple(scale.shape)}"
    )


_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every byte's value


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32, exactly `q.float()`; on the CPU through a 256-entry table (PyTorch's CPU cast
    of fp8 is ~1.7x slower than the lookup)."""
    if q.device.type != "cpu":
        return q.float()
    return _E4M3_TABLE[q.view(torch.uint8).long()]


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q float8_e4m3fn [N, K] with a 4-D, 2-D or scalar tile scale -> W [N, K] in `dtype`."""
    check_dtype("dequantize_fp8_block q", q, (torch.float8_e4m3fn,))
    if q.dim() != 2:
        raise ValueError(f"dequantize_fp8_block q: expected 2 dims [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape
    s = _scale_2d("dequantize_fp8_block scale", scale, _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK))
    s = s.to(q.device)
    if n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0:  # broadcast over the tiles: no expanded [N, K] scale
        tiles = e4m3_to_float(q).view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        return (tiles * s[:, None, :, None]).view(n, k).to(dtype)
    full = s.repeat_interleave(FP8_BLOCK, dim=0)[:n].repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
    return (e4m3_to_float(q) * full).to(dtype)


def quantize_fp8_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-128-column FP8: x [..., K] (K % 128 == 0) -> (q fp8 [..., K], scale fp32
    [..., K/128]) with scale = max(amax_group, 1e-10) / 448 and x ~= q * scale."""
    check_float("quantize_fp8_act_1x128 x", x)
    check_min_dims("quantize_fp8_act_1x128 x", x, 1)
    check_divisible("quantize_fp8_act_1x128 x", x.shape[-1], FP8_BLOCK, "K (last dim)")
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // FP8_BLOCK, FP8_BLOCK)  # [..., K/128, 128]
    scale = div_exact(groups.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_AMAX_FLOOR), FP8_E4M3_MAX)
    q = (groups / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale.squeeze(-1)


def dequantize_fp8_act_1x128(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q fp8 [..., K], scale fp32 [..., K/128] -> x [..., K] in `dtype`."""
    check_dtype("dequantize_fp8_act_1x128 q", q, (torch.float8_e4m3fn,))
    check_dtype("dequantize_fp8_act_1x128 scale", scale, (torch.float32,))
    check_min_dims("dequantize_fp8_act_1x128 q", q, 1)
    check_divisible("dequantize_fp8_act_1x128 q", q.shape[-1], FP8_BLOCK, "K (last dim)")
    check_shape("dequantize_fp8_act_1x128 scale", scale, (*q.shape[:-1], q.shape[-1] // FP8_BLOCK))
    groups = q.float().reshape(*q.shape[:-1], q.shape[-1] // FP8_BLOCK, FP8_BLOCK)
    return (groups * scale.unsqueeze(-1)).reshape(q.shape).to(dtype)
