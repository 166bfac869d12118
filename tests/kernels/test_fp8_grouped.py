"""The grouped FP8_PB_WO expert GEMM (kernels/fp8_grouped.py) against its fp32 reference.

The `interp_` tests run the Triton kernel under the interpreter in a child process
(tests/interpreter_utils.py); the gpu tests run it compiled. Odd shapes: N and K off the 128 grid (edge scale
blocks, masked K tail), picks of other ranks' experts, experts with no picks, one expert taking most picks
(several blocks).
"""

from __future__ import annotations

import pytest
import torch

from k3run.formats import quantize_fp8_block
from k3run.kernels.fp8_grouped import fp8_block_gemm_grouped, fp8_block_gemm_grouped_ref
from k3run.kernels.nvfp4_gemm.tile import expert_blocks
from k3run.testing import assert_close
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

# Each output is one dot product over K of x's values and weights rounded to the activation dtype (the
# reference uses the unrounded fp32 weights), accumulated in fp32, then rounded to the dtype once: relative
# error ~ one rounding of the weights (2^-11 fp16 / 2^-8 bf16, averaged over K terms) plus the output
# rounding (2^-11 / 2^-8), so 2^-9 for fp16 and 2^-6 for bf16 relative RMS; fp32 activations keep the
# weights exact: summation order only, 1e-5.
RTOL = {torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6, torch.float32: 1e-5}


def _case(e: int, n: int, k: int, t: int, a: int, skew: bool, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w, s = [], []
    for _ in range(e):
        q, sc = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.1)
        w.append(q)
        s.append(sc.reshape(-(-n // 128), -(-k // 128)))
    weight, scale = torch.stack(w).to(device), torch.stack(s).float().to(device)
    x = torch.randn(t, k, generator=g).to(dtype=dtype, device=device)
    ids = torch.randint(-2, e + 2, (t * a,), generator=g)  # outside [0, e): another rank's experts
    if skew:
        ids[: t * a * 3 // 4] = 1  # one expert takes most picks (several blocks)
    ids[ids == e - 1] = 0  # the last expert gets no picks
    return x, weight, scale, ids.to(device)


CASES = [
    (5, 200, 320, 37, 3, False),  # N and K off the 128 grid
    (3, 128, 256, 9, 2, True),
    (1, 96, 128, 70, 1, True),  # one expert, most picks on it
]


def _run(e, n, k, t, a, skew, dtype, device, bm=16):
    x, weight, scale, ids = _case(e, n, k, t, a, skew, dtype, device, seed=n + t)
    grp = expert_blocks(ids, e, bm)
    got = fp8_block_gemm_grouped(x, weight, scale, grp, picks=t * a, x_div=a)
    want = fp8_block_gemm_grouped_ref(x, weight, scale, ids.cpu(), a)
    assert_close(f"fp8 grouped {e}x{n}x{k} t={t} a={a} {dtype}", want, got.float().cpu(), rtol=RTOL[dtype])
    miss = ~((ids >= 0) & (ids < e)).cpu()
    assert not bool(got.cpu()[miss].any())  # rows of other ranks' picks are never written


@interp_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_fp8_grouped(case, dtype) -> None:
    _run(*case, dtype, "cpu")


def _fp8_experts(e: int, d: int, i: int, ep_rank: int, ep: int, device: str, seed: int):
    """FP8_PB_WO FusedExperts (rank ep_rank of ep) with random weights, SiTU, fp32 parameters."""
    from k3run.distributed import TPInfo
    from k3run.layers.activation import GatedActivation
    from k3run.layers.moe import FusedExperts
    from k3run.quant.algo import QuantAlgo

    g = torch.Generator().manual_seed(seed)
    act = GatedActivation("situ", beta=1.0, linear_beta=None)
    ex = FusedExperts(e, d, i, act, QuantAlgo.FP8_PB_WO, ep=TPInfo(ep_rank, ep), params_dtype=torch.float32)
    for eid in range(e):
        for which, shape in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
            q, sc = quantize_fp8_block(torch.randn(*shape, generator=g) * 0.2)
            pfx = "w2_" if which == "w2" else "w13_"
            for kind, t in (("weight", q), ("weight_scale", sc)):
                p = getattr(ex, pfx + kind)
                p.weight_loader(p, t, (eid, which))
    return ex.to(device)


def _experts_case(device: str, dtype: torch.dtype) -> None:
    """The FP8 scheme's grouped launches against the per-expert loop on the same weights (EP rank 1 of 2:
    picks of rank 0's experts count zero), D and I off the 128 grid. Both run `expert`'s operations per pick
    (weights dequantized to the dtype, GEMM1 out and h rounded to it); only fp32 summation orders differ,
    which the dtype rounding of GEMM1's output and h can turn into one ulp each: 2^-7 (fp16) / 2^-5 (bf16)
    relative RMS, 1e-5 in fp32."""
    from k3run.layers.moe import fused_experts
    from k3run.quant.experts import FP32_SUM

    ex = _fp8_experts(6, 160, 200, 1, 2, device, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(21, 160, generator=g).to(device=device, dtype=dtype)
    ids = torch.randint(0, 6, (21, 2), generator=g).to(device)
    weights = torch.rand(21, 2, generator=g).to(device)
    loop = fused_experts(ex, x, ids, weights, grouped=False)
    got = ex.scheme.grouped(ex, x, ids, weights, FP32_SUM)
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-7, torch.bfloat16: 2.0**-5}[dtype]
    assert_close(f"fp8 experts grouped {dtype}", loop, got, rtol=rtol)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_fp8_experts_grouped_match_the_loop(dtype) -> None:
    _experts_case("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_experts_grouped_match_the_loop(dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ex = _fp8_experts(2, 128, 128, 0, 1, "cuda", seed=0)
    assert ex.grouped_ok(torch.empty(1, 128, device="cuda", dtype=dtype))  # fused_experts takes them
    _experts_case("cuda", dtype)


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=8)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(16, 1024, 2304, 512, 8, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_grouped(case, dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run(*case, dtype, "cuda", bm=64)


def test_fp8_grouped_refuses_bad_arguments() -> None:
    x, weight, scale, ids = _case(2, 128, 128, 4, 1, False, torch.float32, "cpu", 0)
    grp = expert_blocks(ids, 2, 16)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_block_gemm_grouped(x, weight.float(), scale, grp, picks=4, x_div=1)
    with pytest.raises(ValueError, match="scale must be float32 \\(2, 1, 1\\)"):
        fp8_block_gemm_grouped(x, weight, scale[:, :, :0], grp, picks=4, x_div=1)
    with pytest.raises(ValueError, match="x must be \\[T, 128\\]"):
        fp8_block_gemm_grouped(x[:, :64], weight, scale, grp, picks=4, x_div=1)
