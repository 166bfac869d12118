"""The formats are device-agnostic torch: on CUDA they must give the same bytes as on CPU."""

from __future__ import annotations

import pytest
import torch

from k3run.formats import (
    dequantize_fp8_act_1x128,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    mxfp4_to_nvfp4,
    nvfp4_global_scale,
    nvfp4_qdq,
    quantize_fp8_act_1x128,
    quantize_fp8_block,
    quantize_nvfp4,
)

pytestmark = pytest.mark.gpu


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, device and dtype aside (fp8 compared through its bytes)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and torch.equal(a, b)


def test_nvfp4_cuda_matches_cpu():
    w = torch.randn(3, 64, 160, dtype=torch.bfloat16)
    w[0, :4, :16] = 0
    cpu, gpu = quantize_nvfp4(w), quantize_nvfp4(w.cuda())
    assert gpu.weight.is_cuda and gpu.weight_scale_2.is_cuda
    assert all(same(a, b) for a, b in zip(cpu, gpu, strict=True))
    assert same(dequantize_nvfp4(*cpu), dequantize_nvfp4(*gpu))
    x = torch.randn(7, 160)
    gs = nvfp4_global_scale(x.abs().max())
    assert same(nvfp4_qdq(x, gs), nvfp4_qdq(x.cuda(), gs.cuda()))
    assert same(e2m1_encode(x * 3), e2m1_encode(x.cuda() * 3))


def test_fp8_cuda_matches_cpu():
    w = torch.randn(200, 300)
    (q, s), (qg, sg) = quantize_fp8_block(w), quantize_fp8_block(w.cuda())
    assert same(q, qg) and same(s, sg) and same(dequantize_fp8_block(q, s), dequantize_fp8_block(qg, sg))
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    (q, s), (qg, sg) = quantize_fp8_act_1x128(x), quantize_fp8_act_1x128(x.cuda())
    assert same(q, qg) and same(s, sg)
    assert same(dequantize_fp8_act_1x128(q, s), dequantize_fp8_act_1x128(qg, sg))


def test_mxfp4_cuda_matches_cpu():
    packed = torch.randint(0, 256, (16, 64), dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(110, 128, (16, 4), dtype=torch.int32).to(torch.uint8)  # gaps up to 17: exact
    scale[3, 1], packed[3, 16:32] = 0, 0  # a zero block far below: its codes go through the rewrite
    cpu, gpu = mxfp4_to_nvfp4(packed, scale), mxfp4_to_nvfp4(packed.cuda(), scale.cuda())
    assert all(same(a, b) for a, b in zip(cpu, gpu, strict=True))
    assert same(dequantize_mxfp4(packed, scale), dequantize_mxfp4(packed.cuda(), scale.cuda()))
