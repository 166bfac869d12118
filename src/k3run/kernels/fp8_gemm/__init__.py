"""FP8_PB_WO linear: dynamic 1x128 FP8 activations x 128x128-block FP8 weights, fp32 accumulation.

Backends: "scaled_mm" (block-wise torch._scaled_mm, cuBLAS, sm90 only, K % 512 == 0), "triton"
(fp8_gemm.triton, any GPU Triton supports fp8 dots on), "ref" (fp32 torch, CPU). Resolve the backend once at
load time with `default_backend(device, K)` and pass it to every call.

Measured on an H200 (bench/RESULTS.md, 7168x7168): the whole scaled_mm layer (quantize + GEMM + bias
in the cuBLAS epilogue) takes 1.14x the time of bare _scaled_mm at M = 1 and 1.10x at M = 4096 (1037 vs
1138 TFLOP/s); the Triton fallback reaches ~590 TFLOP/s at M = 4096.
"""

from __future__ import annotations

import functools

import torch

from k3run.kernels.fp8_act_quant import quantize_act_1x128
from k3run.knobs import knobs

from .ref import fp8_block_gemm_ref, fp8_pb_wo_linear_ref

BACKENDS = ("scaled_mm", "triton", "gemv", "ref")
# decode sizes: on CUDA sm_89+, calls of up to this many rows take the split-K GEMV with the quantization
# fused (gemv.fp8_gemv, whose token tile is one 16-row mma block) whatever the layer's backend;
# K3RUN_FP8_GEMV=0 turns it off (for comparisons). Defined here, not in gemv.py, which needs Triton.
FP8_GEMV_MAX_M = 16


def scaled_mm_shape_ok(k: int) -> bool:
    """Measured on an H200 (torch 2.11+cu130, bench/probes/scaled_mm.py): block-wise _scaled_mm is exact for
    K = 7168 (56 scale columns) but returns garbage for K = 640 and 768 (5 and 6 scale columns), with or
    without padding or bias. Only K/128 divisible by 4 is trusted; other K use the Triton GEMM."""
    return k % 512 == 0


def blockwise_scaled_mm_supported(device: torch.device) -> bool:
    """Block-wise (1x128 x 128x128) torch._scaled_mm exists on sm90 with a CUDA >= 12.9 build of torch."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability(device) == (9, 0) and (major, minor) >= (12, 9)


def _gemv_on(device: torch.device) -> bool:
    """The decode GEMV's E4M3 conversions need sm_89+ (Ada, Hopper); K3RUN_FP8_GEMV=0 turns it off."""
    return knobs().fp8_gemv and _fp8_capable(device.index or 0)


@functools.cache
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def default_backend(device: torch.device, k: int) -> str:
    """The backend for a layer with K input columns on `device` (resolve once, at load time)."""
    if device.type != "cuda":
        return "ref"
    return "scaled_mm" if blockwise_scaled_mm_supported(device) and scaled_mm_shape_ok(k) else "triton"


def _check(
    x: torch.Tensor, weight_padded: torch.Tensor, scale_2d: torch.Tensor, n_logical: int, bias
) -> None:
    k = x.shape[-1]
    if k % 128:
        raise ValueError(f"fp8_pb_wo linear input: K={k} must be divisible by 128")
    if weight_padded.dtype != torch.float8_e4m3fn or weight_padded.dim() != 2 or weight_padded.shape[1] != k:
        raise ValueError(
            f"fp8_pb_wo weight: expected float8_e4m3fn [N_pad, {k}], "
            f"got {weight_padded.dtype} {tuple(weight_padded.shape)}"
        )
    n_pad = weight_padded.shape[0]
    if n_pad % 128 or not 0 < n_logical <= n_pad or n_pad - n_logical >= 128:
        raise ValueError(
            f"fp8_pb_wo weight: {n_pad} padded rows, expected n_logical={n_logical} rounded up to 128"
        )
    if scale_2d.dtype != torch.float32 or tuple(scale_2d.shape) != (n_pad // 128, k // 128):
        raise ValueError(
            f"fp8_pb_wo weight_scale: expected fp32 {(n_pad // 128, k // 128)}, "
            f"got {scale_2d.dtype} {tuple(scale_2d.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n_logical,):
        raise ValueError(f"fp8_pb_wo bias: expected [{n_logical}], got {tuple(bias.shape)}")


def fp8_pb_wo_linear(
    x: torch.Tensor,
    weight_padded: torch.Tensor,
    scale_2d: torch.Tensor,
    n_logical: int,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y [..., n_logical] = quant_1x128(x) [..., K] @ weight_padded[:n_logical]^T (+ bias), in x's dtype.

    weight_padded: fp8 [N_pad, K], N_pad = n_logical rounded up to 128 with zero pad rows;
    scale_2d: fp32 [N_pad/128, K/128] weight tile scales. backend None means default_backend(x.device, K).
    On CUDA, up to FP8_GEMV_MAX_M rows run the decode GEMV (quantization fused, one weight pass) instead of
    the backend's GEMM; backend "gemv" asks for it explicitly.
    """
    _check(x, weight_padded, scale_2d, n_logical, bias)
    backend = backend or default_backend(x.device, x.shape[-1])
    if backend not in BACKENDS:
        raise ValueError(f"fp8_pb_wo backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "scaled_mm" and not scaled_mm_shape_ok(x.shape[-1]):
        raise ValueError(
            f"fp8_pb_wo backend 'scaled_mm': K={x.shape[-1]} is not a multiple of 512 (scaled_mm_shape_ok)"
        )
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    decode = x2.is_cuda and 0 < m <= FP8_GEMV_MAX_M and _gemv_on(x2.device)
    if backend == "gemv" or (backend != "ref" and decode):
        from .gemv import fp8_gemv

        return fp8_gemv(x2, weight_padded, scale_2d, n_logical, bias).reshape(*lead, n_logical)
    if backend == "ref":
        ref = fp8_pb_wo_linear_ref
        if x2.device.type == "cpu":  # compiled on large matrices (kernels/fp8_gemm/cpu.py)
            from .cpu import fp8_pb_wo_linear_cpu as ref
        return ref(x2, weight_padded, scale_2d, n_logical, bias).reshape(*lead, n_logical)
    if backend == "triton":
        from .triton import fp8_block_gemm

        q, sx = quantize_act_1x128(x2)
        y = fp8_block_gemm(q, sx, weight_padded, scale_2d, n_logical, x.dtype, bias)
        return y.reshape(*lead, n_logical)
    # cuBLAS block-wise on sm90 wants M % 4 == 0 and outer-dim-major activation scales; the quant kernel
    # writes both directly (zero pad rows). It takes N rows down to a multiple of 16 with the same
    # ceil(N/128) scale rows, so the GEMM reads only rows [0, n16) and writes no padding columns unless
    # n_logical itself is not a multiple of 16 (then one crop copy).
    q, sx = quantize_act_1x128(x2, m_multiple=4, scale_outer_major=True)
    n16 = -(-n_logical // 16) * 16
    # cuBLAS adds a bias of the output dtype in its epilogue when no crop follows
    fuse_bias = bias is not None and n16 == n_logical and bias.dtype == x.dtype
    out = torch._scaled_mm(
        q,
        weight_padded[:n16].t(),
        scale_a=sx,
        scale_b=scale_2d.t(),
        bias=bias if fuse_bias else None,
        out_dtype=x.dtype,
    )
    y = out[:m, :n_logical]
    if bias is not None and not fuse_bias:
        y = torch.add(y, bias.to(y.dtype))
    elif n16 != n_logical:
        y = y.contiguous()
    return y.reshape(*lead, n_logical)


__all__ = [
    "BACKENDS",
    "FP8_GEMV_MAX_M",
    "blockwise_scaled_mm_supported",
    "default_backend",
    "fp8_block_gemm_ref",
    "fp8_pb_wo_linear",
    "fp8_pb_wo_linear_ref",
    "scaled_mm_shape_ok",
]
