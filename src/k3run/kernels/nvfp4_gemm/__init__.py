"""NVFP4 W4A16 linear: the layout prepared once at load time and the per-call implementation choice.

CUDA inputs run the Triton kernels (decode in registers for small M, dequantize + cuBLAS for large M);
everything else runs the fp32 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ref import nvfp4_linear_ref


@dataclass(frozen=True)
class NvFp4Weight:
    """A checkpoint NVFP4 weight in the layout the kernels read.

    weight: uint8 [N, K/2] packed E2M1, low nibble = even k.
    scale_bits: uint8 [N, K/16], the E4M3 group scales as raw bytes (Triton loads fp8 through uint8).
    global_scale: fp32 [1] (per tensor) or [N] (fused shards with their own global scales), decode scale.
    """

    weight: torch.Tensor
    scale_bits: torch.Tensor
    global_scale: torch.Tensor

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1] * 2


@dataclass(frozen=True)
class GemmConfig:
    """One launch of `nvfp4_gemm` (dequant_mm=True: dequantize the weight, then cuBLAS)."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    decode: int = 0
    dequant_mm: bool = False


def prepare_nvfp4_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> NvFp4Weight:
    """Check the checkpoint tensors once and return the kernel layout (no copy when already contiguous).

    weight_scale_2 may be 0-dim/one element (per tensor) or [N] (one decode scale per output row).
    """
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"nvfp4 weight: expected uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if k % 16:
        raise ValueError(f"nvfp4 weight: K={k} must be a multiple of 16")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // 16):
        raise ValueError(
            f"nvfp4 weight_scale: expected float8_e4m3fn {(n, k // 16)}, "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() not in (1, n):
        raise ValueError(
            f"nvfp4 weight_scale_2: expected fp32 with 1 or {n} elements, "
            f"got {weight_scale_2.dtype} {tuple(weight_scale_2.shape)}"
        )
    return NvFp4Weight(
        weight=weight.contiguous(),
        scale_bits=weight_scale.contiguous().view(torch.uint8),
        global_scale=weight_scale_2.reshape(-1).contiguous(),
    )


def choose_config(m: int, n: int, k: int) -> GemmConfig:
    """The launch for M rows (decode: stream the weight once; prefill: big tiles or dequantize + cuBLAS)."""
    if m <= 16:
        return GemmConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)
    if m <= 64:
        return GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m < 1024:
        return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return GemmConfig(dequant_mm=True)


def nvfp4_linear(
    x: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias in x's dtype (bf16/fp16 on CUDA; any float dtype on CPU)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"nvfp4 linear: input has K={x.shape[-1]}, weight has K={w.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if not x2.is_cuda:
        scale = w.scale_bits.view(torch.float8_e4m3fn)
        return nvfp4_linear_ref(x2, w.weight, scale, w.global_scale, bias).reshape(*lead, w.n)
    from .triton import nvfp4_dequantize, nvfp4_gemm

    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = config or choose_config(x2.shape[0], w.n, w.k)
    if cfg.dequant_mm:
        wd = nvfp4_dequantize(w.weight, w.scale_bits, w.global_scale, x2.dtype)
        y = torch.nn.functional.linear(x2, wd, bias)
    else:
        y = nvfp4_gemm(
            x2,
            w.weight,
            w.scale_bits,
            w.global_scale,
            bias,
            block_m=cfg.block_m,
            block_n=cfg.block_n,
            block_k=cfg.block_k,
            group_m=cfg.group_m,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            decode=cfg.decode,
        )
    return y.reshape(*lead, w.n)


__all__ = [
    "GemmConfig",
    "NvFp4Weight",
    "choose_config",
    "nvfp4_linear",
    "nvfp4_linear_ref",
    "prepare_nvfp4_weight",
]
