"""NVFP4 W4A16 linear: `nvfp4_linear` dispatches each call; `layout.py` prepares the weight once at load time,
`config.py` picks the kernel and launch for M rows; every public name of both is re-exported here.

CUDA inputs (`choose_config` picks, `nvfp4_linear` runs): the Gluon decode kernel (gluon_gemv.py) up to 32
rows (33..64 in two launches on large matrices); on sm_90 for 17..1024 rows the CUDA C++ GEMM of w4a16_sm90.cu
on matrices of >= 32M weights (built at first use), for 17..256 the Gluon wgmma GEMM of wgmma.py on smaller
ones from 33 rows (17..32 rows stay on the decode kernel there), where the CUDA GEMM cannot be built, or with
K3RUN_SM90_CUDA=0; elsewhere the tensor-core tile GEMM (tile.py) up to 128 rows; dequantize + cuBLAS above
(with K3RUN_DEQUANT_CHUNKS, in row chunks dequantized on a second stream beside cuBLAS: dequant_mm.py).
CPU inputs run cpu.py (compiled loops or the SIMD extension on large matrices, the fp32 reference otherwise).
`nvfp4_to_fp8_block` is the opt-in, lossy conversion to FP8 blocks for fp8_gemm (`--nvfp4-as-fp8`;
quant/schemes.py says where it is used).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3run.knobs import knobs

from .config import (
    DEFAULT_SMS,
    GEMV_AUTO_M,
    GEMV_MAX_M,
    GEMV_PAIR_MIN_WEIGHTS,
    GEMV_REGS_T16,
    GEMV_REGS_T16_CAPPED,
    GEMV_REGS_T32,
    TILE_MAX_M,
    TRITON_DECODE,
    WGMMA_MAX_M,
    WGMMA_MIN_M,
    WGMMA_SMALL_M_MIN_WEIGHTS,
    GemmConfig,
    choose_config,
    one_wave_split,
    programs_per_sm,
    sm_count,
)
from .layout import (
    CHUNK,
    LAYOUTS,
    TILED_PAIR_BITS,
    TILED_SCALE_ORDER,
    NvFp4Weight,
    check_scale_bytes,
    default_cuda_layout,
    nvfp4_to_fp8_block,
    prepare_nvfp4_weight,
    repack_split128,
    tile_split128,
    tiled_word,
    unpack_split128,
    untile_split128,
)
from .ref import nvfp4_linear_ref

_GEMV_OK: bool | None = None


def gemv_available() -> bool:
    """Whether the Gluon decode kernel can be used here (Triton with Gluon, a CUDA GPU of sm_80 or later)."""
    global _GEMV_OK
    if _GEMV_OK is None:
        try:
            from . import gluon_gemv  # noqa: F401

            _GEMV_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
        except Exception as e:  # an old Triton without Gluon, or its API changed
            import logging

            logging.getLogger(__name__).warning("nvfp4: Gluon decode kernel unavailable (%s)", e)
            _GEMV_OK = False
    return _GEMV_OK


def _fallback(m: int) -> GemmConfig:
    return TRITON_DECODE if m <= 16 else GemmConfig(dequant_mm=True)


def _disable_gemv(err: Exception) -> None:
    global _GEMV_OK
    import logging

    logging.getLogger(__name__).warning(
        "nvfp4: Gluon decode kernel failed to compile, Triton fallback: %s", err
    )
    _GEMV_OK = False


_WGMMA_OK = True  # False once the wgmma GEMM failed to compile


@functools.cache
def _wgmma_device(index: int) -> bool:
    """CUDA device `index` runs the wgmma GEMM: sm_90 and its Gluon module importable."""
    try:
        from .wgmma import wgmma_available
    except ImportError:
        return False
    return wgmma_available(torch.device("cuda", index))


def _wgmma_ok(device: torch.device) -> bool:
    return _WGMMA_OK and device.type == "cuda" and _wgmma_device(device.index or 0)


def _disable_wgmma(err: Exception) -> None:
    global _WGMMA_OK
    import logging

    logging.getLogger(__name__).warning("nvfp4: the wgmma GEMM failed to compile, other kernels: %s", err)
    _WGMMA_OK = False


def _gemv(x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """The Gluon decode kernel, one launch per 32 rows (its widest token tile); on sm_90 up to K3RUN_SM90_GEMV
    rows of a tiled128 weight the CUDA C++ decode GEMV (w4a16_sm90.nvfp4_sm90_gemv) at the same split_k."""
    from . import w4a16_sm90
    from .gluon_gemv import nvfp4_gemv, token_tile

    half = x2.dtype in (torch.bfloat16, torch.float16)
    if w.layout == "tiled128" and half and w4a16_sm90.gemv_takes(x2.shape[0], w.k):
        if w4a16_sm90.available(x2.device):
            return w4a16_sm90.nvfp4_sm90_gemv(
                x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias, split_k=cfg.split_k
            )

    parts = [
        nvfp4_gemv(
            x2[i : i + 32],
            w.weight,
            w.scale_bits,
            w.global_scale,
            bias,
            num_warps=cfg.num_warps,
            split_k=cfg.split_k,
            stages=cfg.smem_stages,
            tiled=w.layout == "tiled128",
            rows=w.n,
            maxnreg=cfg.maxnreg,
            # token warps on the 32-token tile only (2 on the 16-token tile ran up to 16% slower on an H100)
            token_warps=cfg.token_warps if token_tile(x2.shape[0] - i) == 32 else 1,
        )
        for i in range(0, x2.shape[0], 32)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _wgmma(x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """17..256 rows on sm_90 (17..w4a16_sm90.MAX_M on the matrices it takes): the CUDA C++ GEMM on large
    matrices where enabled and built (w4a16_sm90.takes), else the Gluon wgmma GEMM; None (and the Gluon
    kernel disabled) when Triton cannot build it."""
    from k3run.kernels.build_errors import BUILD_ERRORS, triton_build_failed

    from . import w4a16_sm90
    from .wgmma import nvfp4_wgmma_gemm

    if w4a16_sm90.takes(w.n, w.k) and w4a16_sm90.available(x2.device):  # CUDA C++, built at first use
        return w4a16_sm90.nvfp4_sm90_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    try:
        return nvfp4_wgmma_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    except BUILD_ERRORS as e:
        if not triton_build_failed(e):
            raise
        _disable_wgmma(e)
        return None


def nvfp4_linear(
    x: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None = None, config: GemmConfig | None = None
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias in x's dtype (bf16/fp16 on CUDA; any float dtype on CPU)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"nvfp4 linear: input has K={x.shape[-1]}, weight has K={w.k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    if not x2.is_cuda:
        from .cpu import nvfp4_linear_cpu

        weight, scale = w.checkpoint_tensors()
        y = nvfp4_linear_cpu(x2, weight, scale, w.row_global_scale, bias, int8=w.cpu_int8)
        return y.reshape(*lead, w.n)
    if w.layout not in ("split128", "tiled128"):
        raise ValueError(f"nvfp4 linear: CUDA inputs need a split128 or tiled128 weight, got {w.layout!r}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _cuda_linear(x2, w, bias, _cuda_config(x2, w, config)).reshape(*lead, w.n)


def _cuda_config(x2: torch.Tensor, w: NvFp4Weight, config: GemmConfig | None) -> GemmConfig:
    """The launch for x2 [M, K] on CUDA: `config` or `choose_config`'s, moved to a path this weight's layout,
    x's dtype and this Triton have."""
    tiled = w.layout == "tiled128"
    half = x2.dtype in (torch.bfloat16, torch.float16)
    cfg = config or choose_config(
        x2.shape[0], w.n, w.k, sm_count(x2.device.index or 0), wgmma=tiled and half and _wgmma_ok(x2.device)
    )
    if (cfg.tile or cfg.wgmma) and not (tiled and half):
        cfg = GemmConfig(dequant_mm=True)
    if config is None and cfg.dequant_mm and tiled and half and WGMMA_MAX_M < x2.shape[0]:
        from . import w4a16_sm90

        if x2.shape[0] <= w4a16_sm90.MAX_M and w4a16_sm90.takes(w.n, w.k) and w4a16_sm90.available(x2.device):
            cfg = GemmConfig(wgmma=True)  # _wgmma runs the CUDA C++ GEMM on what it takes
    if tiled and not (cfg.dequant_mm or cfg.tile or cfg.wgmma or (cfg.gemv and cfg.smem_stages)):
        raise ValueError(
            "nvfp4 linear: a tiled128 weight runs the cp.async decode kernel, the tile GEMM or dequantize + "
            "cuBLAS, not "
            f"{cfg}; prepare the weight with layout='split128' for the other kernels"
        )
    if cfg.gemv and not (
        x2.shape[0] <= GEMV_MAX_M and x2.dtype in (torch.bfloat16, torch.float16) and gemv_available()
    ):
        cfg = GemmConfig(dequant_mm=True) if tiled else _fallback(x2.shape[0])
    return cfg


def _cuda_linear(
    x2: torch.Tensor, w: NvFp4Weight, bias: torch.Tensor | None, cfg: GemmConfig
) -> torch.Tensor:
    """y [M, N] on CUDA by `cfg`'s path; a kernel that fails to build turns itself off and the next path in
    line runs (wgmma -> choose_config's next, the Gluon GEMV -> dequantize + cuBLAS or the Triton GEMM)."""
    from .triton import nvfp4_dequantize, nvfp4_gemm

    tiled = w.layout == "tiled128"
    y = None
    if cfg.wgmma:
        y = _wgmma(x2, w, bias)
        if y is None:  # the Gluon kernel failed to build: the other paths from now on
            cfg = choose_config(x2.shape[0], w.n, w.k, sm_count(x2.device.index or 0))
    if cfg.tile:
        from .tile import nvfp4_tile_gemm

        y = nvfp4_tile_gemm(x2, w.weight, w.scale_bits, w.global_scale, w.k, w.n, bias)
    if cfg.gemv:
        from triton.compiler.errors import CompilationError

        try:
            y = _gemv(x2, w, bias, cfg)
        except CompilationError as e:  # a Triton whose Gluon API moved: use the Triton kernels from now on
            _disable_gemv(e)
            cfg = GemmConfig(dequant_mm=True) if tiled else _fallback(x2.shape[0])
    chunks = knobs().dequant_chunks
    if y is None and cfg.dequant_mm and chunks > 1 and tiled:
        from .dequant_mm import dequant_mm_chunked

        y = dequant_mm_chunked(x2, w, bias, chunks)
    if y is None and cfg.dequant_mm:
        wd = nvfp4_dequantize(
            w.weight, w.scale_bits, w.global_scale, w.k, x2.dtype, rows=w.n if tiled else None
        )
        y = F.linear(x2, wd, bias)
    elif y is None:
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
            decode=cfg.decode if x2.dtype != torch.float32 else 0,
            split_k=cfg.split_k,
        )
    return y


__all__ = [
    "CHUNK",
    "DEFAULT_SMS",
    "GEMV_AUTO_M",
    "GEMV_MAX_M",
    "GEMV_PAIR_MIN_WEIGHTS",
    "GEMV_REGS_T16",
    "GEMV_REGS_T16_CAPPED",
    "GEMV_REGS_T32",
    "LAYOUTS",
    "TILED_PAIR_BITS",
    "TILED_SCALE_ORDER",
    "TILE_MAX_M",
    "TRITON_DECODE",
    "WGMMA_MAX_M",
    "WGMMA_MIN_M",
    "WGMMA_SMALL_M_MIN_WEIGHTS",
    "GemmConfig",
    "NvFp4Weight",
    "check_scale_bytes",
    "choose_config",
    "default_cuda_layout",
    "gemv_available",
    "nvfp4_linear",
    "nvfp4_linear_ref",
    "nvfp4_to_fp8_block",
    "one_wave_split",
    "prepare_nvfp4_weight",
    "programs_per_sm",
    "repack_split128",
    "sm_count",
    "tile_split128",
    "tiled_word",
    "unpack_split128",
    "untile_split128",
]
