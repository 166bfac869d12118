"""Pure-torch exact numerics of the checkpoint formats; the oracle every kernel is tested against."""

from __future__ import annotations

from k3run.formats.e2m1 import E2M1_MAX, E2M1_VALUES, e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from k3run.formats.fp8_block import (
    FP8_BLOCK,
    FP8_E4M3_MAX,
    dequantize_fp8_act_1x128,
    dequantize_fp8_block,
    quantize_fp8_act_1x128,
    quantize_fp8_block,
)
from k3run.formats.mxfp4 import (
    MXFP4_GROUP,
    Mxfp4Scales,
    dequantize_mxfp4,
    e8m0_to_float,
    mxfp4_codes_to_nvfp4,
    mxfp4_k_max,
    mxfp4_scales_to_nvfp4,
    mxfp4_to_nvfp4,
)
from k3run.formats.nvfp4 import (
    NVFP4_GROUP,
    NvFp4Tensor,
    dequantize_nvfp4,
    nvfp4_global_scale,
    nvfp4_qdq,
    nvfp4_quantize_blocks,
    quantize_nvfp4,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "MXFP4_GROUP",
    "Mxfp4Scales",
    "NVFP4_GROUP",
    "NvFp4Tensor",
    "dequantize_fp8_act_1x128",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_to_float",
    "mxfp4_codes_to_nvfp4",
    "mxfp4_k_max",
    "mxfp4_scales_to_nvfp4",
    "mxfp4_to_nvfp4",
    "nvfp4_global_scale",
    "nvfp4_qdq",
    "nvfp4_quantize_blocks",
    "pack_e2m1",
    "quantize_fp8_act_1x128",
    "quantize_fp8_block",
    "quantize_nvfp4",
    "unpack_e2m1",
]
