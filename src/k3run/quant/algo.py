"""The quantization algorithms a layer can use (ModelOpt's quant_algo names)."""

from __future__ import annotations

from enum import StrEnum


class QuantAlgo(StrEnum):
    NONE = "NONE"  # unquantized: bf16 / fp16 / fp32 weights
    FP8 = "FP8"  # per-tensor fp8 weights and static per-tensor activation scale
    FP8_PB_WO = "FP8_PB_WO"  # 128x128 block fp8 weights, dynamic 1x128 activation groups
    NVFP4 = "NVFP4"  # E2M1 weights, E4M3 scale per 16 along K, fp32 global scale (+ input_scale)
    W4A16_NVFP4 = "W4A16_NVFP4"  # NVFP4 weights, activations stay 16-bit
    # compressed-tensors mxfp4-pack-quantized: E2M1 codes, E8M0 scale per 32; routed experts only, cast
    # losslessly to NVFP4 at load and run as W4A16_NVFP4
    MXFP4 = "MXFP4"

    @classmethod
    def parse(cls, name: str, field: str = "quant_algo") -> QuantAlgo:
        key = str(name).strip().upper()
        try:
            return cls(key)
        except ValueError:
            supported = ", ".join(a.value for a in cls if a is not cls.NONE)
            raise ValueError(
                f"{field}: unsupported quantization algorithm {name!r}; supported: {supported}"
            ) from None
