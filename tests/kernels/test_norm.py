"""Fused RMSNorm (plain and sigmoid-gated) and the K3 AttnRes mix against their fp32 torch references.

Error bounds, elementwise, derived by counting fp32 roundings (u = 2^-24 each, first order). The kernel and
the reference evaluate the same formula in fp32 in different orders (and the GPU's exp, sqrt and division
are approximate to ~2 u), so each is within B of the exact value and they are within 2B of each other:
- rms_norm, row length D: the mean of squares is D squarings and D - 1 additions of non-negative terms and
  one division (relative (D + 1) u), + eps (1 u); the square root halves that, its evaluation and the
  reciprocal cost 4 u; x * r * w 2 u: B = ((D + 1) / 2 + 7) u |y|. The gate sigmoid(g) = 1 / (1 + exp(-g))
  adds (|g| + 6) u (exp as 2^(g log2 e): the scaled argument's rounding costs |g| u).
- attn_res_mix, n candidates: each score s = r sum_j v_j q_j takes D + 2 roundings on sum_j |v_j q_j| r
  plus r's error: delta <= (D + 2 + eps_r) u A with A = r sum_j |v_j q_j|. The softmax moves each
  probability by <= 2 max delta relative, plus its own exp (|s - max| + 2), the normaliser's worst exp,
  n - 1 additions, a subtraction and a division; the weighted sum takes n more roundings of p |v|.
16-bit outputs are rounded once from those fp32 values: one output ulp more where they straddle a midpoint.
Each check is also shown to reject a small real slip on the same data (rms_norm: eps 10x; the mix: the
query off by 1%).

The `interp_` tests run only inside the TRITON_INTERPRET=1 child process started by
`test_triton_kernels_in_interpreter`, so the interpreter flag never leaks into other test modules. The
interpreter mishandles bf16 math (toolchain notes), so it runs fp32 and fp16 only.
"""

from __future__ import annotations

import pytest
import torch

from k3run.kernels.norm import add_rms_norm_ref, attn_res_mix_ref, rms_norm_ref
from k3run.testing import FP32_U, RTOL, assert_close, assert_within, output_ulp
from tests.interpreter_utils import interp_only, run_interp_tests_in_child

U = FP32_U
# assert_close bounds: rtol=RTOL[output dtype] (k3run.testing), which holds here because:
# 16-bit outputs, in addition: each is one rounding of an fp32 value the two agree on far below an output
# ulp, so their relative RMS difference is under one ulp (the worst-case elementwise bound above grows with D
# and is loose at D in the thousands; this one does not)


def _rows(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    # rows of very different scales, so the per-row normalisation matters
    x = torch.randn(*shape) * torch.logspace(-2, 2, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    return x.to(dtype).to(device)


def rms_norm_bound(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor | None, eps: float) -> torch.Tensor:
    """2B + one output ulp (module docstring) for rms_norm of these inputs."""
    d = x.shape[-1]
    y = rms_norm_ref(x.float(), w.float(), eps, None if g is None else g.float())
    per = ((d + 1) / 2 + 7) + (0.0 if g is None else g.float().abs() + 6)
    return 2 * per * U * y.abs() + output_ulp(y, x.dtype)


def attn_res_mix_bound(cands: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """2B + one output ulp (module docstring) for attn_res_mix of these inputs."""
    v = torch.stack([c.float() for c in cands])  # [n, T, D]
    n, d = v.shape[0], v.shape[-1]
    q = query.float()
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [n, T]
    eps_r = (d + 1) / 2 + 7
    a = r * (v.abs() @ q.abs())  # [n, T]
    delta = (d + 2 + eps_r) * U * a
    s = r * (v @ q)
    gap = s.max(0).values - s  # [n, T] >= 0
    eps_p = 2 * delta.max(0).values + (gap + 2 + (gap.max(0).values + 2) + (n - 1) + 2) * U
    per_out = ((eps_p + n * U).unsqueeze(-1) * torch.softmax(s, 0).unsqueeze(-1) * v.abs()).sum(0)
    y = attn_res_mix_ref([c.float() for c in cands], query, eps)
    return 2 * per_out + output_ulp(y, cands[0].dtype)


def _check_rms(dtype: torch.dtype, device: str, shape: tuple[int, ...], gated: bool) -> None:
    from k3run.kernels.norm.triton import rms_norm_triton

    x = _rows(shape, dtype, device)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype).to(device)
    g = torch.randn(shape).to(dtype).to(device) * 3 if gated else None
    out = rms_norm_triton(x, w, 1e-5, g)
    ref = rms_norm_ref(x, w, 1e-5, g)
    assert out.dtype == dtype and out.shape == x.shape
    bound = rms_norm_bound(x.cpu(), w.cpu(), None if g is None else g.cpu(), 1e-5)
    assert_within("rms_norm", ref.float(), out.float(), bound)
    if dtype in RTOL:
        assert_close("rms_norm rms", ref.float(), out.float(), RTOL[dtype])
    # the bound is tight enough to see a slip: eps 10x too large moves the small-scale rows past it
    with pytest.raises(AssertionError, match="outside their error bound"):
        assert_within("rms_norm eps slip", rms_norm_ref(x, w, 1e-4, g).float(), out.float(), bound)


def _check_add_rms(dtype: torch.dtype, device: str, shape: tuple[int, ...]) -> None:
    """The fused residual add: the sum bit for bit torch's add in dtype; the norm bit for bit the plain
    kernel's on that sum (the same loads and operations), within rms_norm's bound of the reference; 16-bit
    outputs in out_dtype fp32 equal the fp32 norm widened."""
    from k3run.kernels.norm.triton import rms_norm_triton

    x = _rows(shape, dtype, device)
    r = _rows(shape, dtype, device).flip(0)  # residuals of other scales than x's rows
    w = (torch.rand(shape[-1]) + 0.5).to(dtype).to(device)
    y, s = rms_norm_triton(x, w, 1e-5, residual=r)
    assert torch.equal(s, x + r) and s.dtype == dtype
    assert torch.equal(y, rms_norm_triton(s, w, 1e-5))
    ref_y, ref_s = add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(ref_s, s)
    bound = rms_norm_bound(s.cpu(), w.cpu(), None, 1e-5)
    assert_within("add_rms_norm", ref_y.float(), y.float(), bound)
    wide = rms_norm_triton(s, w, 1e-5, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.to(dtype), y)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w, 1e-5, residual=r[..., 1:])


def _check_mix(dtype: torch.dtype, device: str, n: int, t: int, d: int) -> None:
    from k3run.kernels.norm.triton import attn_res_mix_triton

    cands = [_rows((t, d), dtype, device) * (i + 1) for i in range(n)]
    query = torch.randn(d, device=device) / d**0.5 * 8  # peaked softmaxes as well as flat ones
    out = attn_res_mix_triton(cands, query, 1e-5)
    ref = attn_res_mix_ref(cands, query, 1e-5)
    assert out.dtype == dtype and out.shape == (t, d)
    bound = attn_res_mix_bound([c.cpu() for c in cands], query.cpu(), 1e-5)
    assert_within("attn_res_mix", ref.float(), out.float(), bound)
    if dtype in RTOL:
        assert_close("attn_res_mix rms", ref.float(), out.float(), RTOL[dtype])
    # one candidate has softmax weight 1 whatever its score. At D in the thousands neither check sees a 1%
    # query slip (measured on an H200 at D = 4099 and 7168): the worst-case score bound
    # (D sum_j |k_j q_j| u ~ 5 D^1.5 u) admits tens of percent on a weight there, and the slip moves bf16
    # outputs by less than an ulp RMS; the sizes up to 1024 (the interpreter's 129, the GPU's 128) show it
    if n > 1 and d <= 1024:
        slipped = attn_res_mix_ref(cands, query * (1 + 1e-2), 1e-5)
        assert _rejects(slipped, out, bound, dtype), "a 1% query slip passes the checks"


def _rejects(ref: torch.Tensor, out: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the checks above fail `out` against a slipped reference."""
    try:
        assert_within("slip", ref.float(), out.float(), bound)
        if dtype in RTOL:
            assert_close("slip rms", ref.float(), out.float(), RTOL[dtype])
    except AssertionError:
        return True
    return False


def test_triton_kernels_in_interpreter():
    """Run this file's `interp_` tests in a child with TRITON_INTERPRET=1."""
    run_interp_tests_in_child(__file__, expected_passed=11)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_interp_rms_norm(dtype: torch.dtype, gated: bool) -> None:
    _check_rms(dtype, "cpu", (5, 3, 129), gated)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_add_rms_norm(dtype: torch.dtype) -> None:
    _check_add_rms(dtype, "cpu", (5, 129))


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3])
def test_interp_attn_res_mix(dtype: torch.dtype, n: int) -> None:
    _check_mix(dtype, "cpu", n, 3, 129)


def _check_parameter_weight(device: str) -> None:
    """A module's weight (an nn.Parameter: read before the PDL wait) gives the same bits as the same values
    in a plain tensor (read after it), for the plain, gated and fused-add forms, with x written by the
    launch just before (the wait must still guard x)."""
    from k3run.kernels.norm.triton import rms_norm_triton

    x0, r = _rows((5, 129), torch.float32, device), _rows((5, 129), torch.float32, device).flip(0)
    g = torch.randn(5, 129).to(device)
    w = (torch.rand(129) + 0.5).to(device)
    p = torch.nn.Parameter(w.clone(), requires_grad=False)
    for args in ((), (g,)):
        assert torch.equal(rms_norm_triton(x0 * 3, p, 1e-5, *args), rms_norm_triton(x0 * 3, w, 1e-5, *args))
    y_p, s_p = rms_norm_triton(x0 * 3, p, 1e-5, residual=r)
    y_w, s_w = rms_norm_triton(x0 * 3, w, 1e-5, residual=r)
    assert torch.equal(y_p, y_w) and torch.equal(s_p, s_w)


@interp_only
def test_interp_parameter_weight_same_bits() -> None:
    _check_parameter_weight("cpu")


def test_cpu_dispatch_is_the_reference_bit_for_bit() -> None:
    from k3run.kernels.norm import attn_res_mix, rms_norm

    x, g = torch.randn(4, 37).bfloat16(), torch.randn(4, 37).bfloat16()
    w = torch.rand(37).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5, g), rms_norm_ref(x, w, 1e-5, g))
    from k3run.kernels.norm import add_rms_norm

    y, s = add_rms_norm(x, g, w, 1e-5)
    assert torch.equal(s, x + g) and torch.equal(y, rms_norm_ref(x + g, w, 1e-5))
    cands, q = [torch.randn(4, 37).bfloat16() for _ in range(3)], torch.randn(37)
    assert torch.equal(attn_res_mix(cands, q, 1e-5), attn_res_mix_ref(cands, q, 1e-5))


def test_kernel_argument_errors_name_the_mismatch() -> None:
    from k3run.kernels.norm.triton import attn_res_mix_triton, rms_norm_triton

    with pytest.raises(ValueError, match="weight has 5 elements"):
        rms_norm_triton(torch.randn(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(ValueError, match="query has 3 elements"):
        attn_res_mix_triton([torch.randn(2, 4)], torch.ones(3), 1e-5)


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 7168), (7, 3584), (9, 96, 128), (3, 4097)])
@pytest.mark.parametrize("gated", [False, True])
@GPU[0]
@GPU[1]
def test_gpu_rms_norm(dtype: torch.dtype, shape: tuple[int, ...], gated: bool) -> None:
    _check_rms(dtype, "cuda", shape, gated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2304), (7, 7168), (3, 4097)])
@GPU[0]
@GPU[1]
def test_gpu_add_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _check_add_rms(dtype, "cuda", shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "t", "d"), [(1, 1, 7168), (2, 8, 7168), (9, 5, 4099), (13, 3, 128)])
@GPU[0]
@GPU[1]
def test_gpu_attn_res_mix(dtype: torch.dtype, n: int, t: int, d: int) -> None:
    _check_mix(dtype, "cuda", n, t, d)


@GPU[0]
@GPU[1]
def test_gpu_parameter_weight_same_bits() -> None:
    _check_parameter_weight("cuda")
