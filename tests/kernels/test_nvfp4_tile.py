"""The NVFP4 tile GEMM (kernels/nvfp4_gemm/tile.py), dense and grouped, against the fp32 reference, and
expert_blocks against the decode table's reference.

Error bound (elementwise, stated from the dtypes): the decoded weights are exact in 16-bit floats, so every
product x_k * w_k is exact in fp32 and the kernel and the reference differ only by the order of K fp32
additions: each is within K u sum_k |x_k w_k| of the exact sum (u = 2^-24), and the tensor cores' accumulation
is allowed twice that, so |out - ref| <= 3 K u (|x| @ |W|^T) |gs| + one output ulp (the single rounding of the
output to a 16-bit dtype, where the two fp32 sums may sit on either side of a rounding midpoint).

The `interp_` tests run the portable decoder under the Triton interpreter in a child process
(tests/interpreter_utils.py); the gpu tests run the compiled kernels with the PTX decoder.
"""

from __future__ import annotations

import re

import pytest
import torch

from k3run.formats import dequantize_nvfp4, quantize_nvfp4
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
from k3run.kernels.nvfp4_gemm.groups import expert_groups_ref
from k3run.kernels.nvfp4_gemm.tile import expert_blocks
from k3run.testing import FP32_U, assert_within, output_ulp
from tests.interpreter_utils import interp_only, run_interp_tests_in_child


def _random_nvfp4(n: int, k: int, device: str, per_row: bool, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1.0 + 4.0 * (torch.rand(n, 1, generator=g) > 0.8))
    q = quantize_nvfp4(w)
    gs = q.weight_scale_2.reshape(1).float()
    if per_row:
        gs = gs * (0.5 + torch.rand(n, generator=g))
    return q.weight.to(device), q.weight_scale.to(device), gs.to(device)


def _bound(x: torch.Tensor, wd: torch.Tensor, gs: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    """3 K u (|x| @ |W|^T) |gs| + one ulp of `dtype` at the reference (module docstring)."""
    k = x.shape[-1]
    mag = (x.float().abs() @ wd.float().abs().t()) * gs.float().abs().reshape(1, -1)
    return 3 * k * FP32_U * mag + output_ulp(ref, dtype)


def _dense_case(m: int, n: int, k: int, dtype: torch.dtype, device: str, per_row: bool, bias: bool):
    from k3run.kernels.nvfp4_gemm.tile import nvfp4_tile_gemm

    w, s, gs = _random_nvfp4(n, k, device, per_row, seed=m * 7 + n + k)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = nvfp4_tile_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    if b is not None:
        ref = ref + b.float()
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within(f"tile gemm {m}x{n}x{k} {dtype}", ref, out, _bound(x, wd, gs, ref, dtype))


def _grouped_case(
    t: int, a: int, e: int, n: int, k: int, bm: int, dtype: torch.dtype, device: str, skew: str, fn=None
):
    """t tokens x a picks over e local experts (ids outside [0, e) are another rank's); skew "one": every pick
    on expert 1 (the others get no tokens). fn: the grouped launch under test (default the tile GEMM's)."""
    from k3run.kernels.nvfp4_gemm.tile import nvfp4_tile_gemm_grouped

    fn = fn or nvfp4_tile_gemm_grouped

    g = torch.Generator().manual_seed(t * 31 + e)
    if skew == "one":
        ids = torch.full((t, a), 1, dtype=torch.int64)
        ids[:, 1:] = e + 3  # other ranks' experts
    else:
        ids = torch.stack([torch.randperm(e + 4, generator=g)[:a] - 2 for _ in range(t)])
    ws, ss, gss, wds = [], [], [], []
    for j in range(e):
        w, s, gs = _random_nvfp4(n, k, device, per_row=j % 2 == 1, seed=j * 5 + n)
        tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
        ws.append(tw.weight)
        ss.append(tw.scale_bits)
        gss.append(gs.expand(n) if gs.numel() == 1 else gs)
        wds.append(dequantize_nvfp4(w, s, 1.0, dtype=torch.float32))
    weight, scale, gsn = torch.stack(ws), torch.stack(ss), torch.stack(gss).contiguous()
    x = torch.randn(t, k, device=device).to(dtype)
    flat = ids.reshape(-1).to(device)
    grp = expert_blocks(flat, e, bm)
    out = fn(x, weight, scale, gsn, grp, picks=t * a, x_div=a, k=k)
    ref = torch.zeros(t * a, n)
    bound = torch.zeros(t * a, n)
    for p, eid in enumerate(flat.tolist()):
        if 0 <= eid < e:
            xr = x[p // a : p // a + 1]
            r = (xr.float() @ wds[eid].t()) * gsn[eid].reshape(1, -1)
            ref[p] = r[0].cpu()
            bound[p] = _bound(xr, wds[eid], gsn[eid], r, dtype)[0].cpu()
    assert_within(f"grouped tile gemm t={t} a={a} e={e} {n}x{k} bm={bm} {dtype}", ref, out, bound)


@pytest.mark.parametrize(
    "t, a, e, bm", [(1, 1, 1, 16), (7, 3, 5, 4), (40, 8, 16, 16), (300, 8, 64, 64), (9, 2, 300, 8)]
)
def test_expert_blocks_matches_the_decode_table_reference(t: int, a: int, e: int, bm: int) -> None:
    """expert_blocks builds the decode launch's table (same shape, same entries) with sorts and scatters."""
    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e + 5, generator=g)[:a] - 2 for _ in range(t)]).reshape(-1)
    assert torch.equal(expert_blocks(ids, e, bm), expert_groups_ref(ids, e, bm))


@interp_only
@pytest.mark.parametrize(
    "t, a, e, bm", [(1, 1, 1, 16), (7, 3, 5, 4), (40, 8, 16, 16), (300, 8, 64, 64), (9, 2, 300, 8)]
)
def test_interp_expert_blocks_kernel(t: int, a: int, e: int, bm: int) -> None:
    """The Triton form (CUDA's default) gives the reference's table: misses, experts without picks, several
    blocks per expert, picks spanning more than one 1024-pick chunk (300 x 8)."""
    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e + 5, generator=g)[:a] - 2 for _ in range(t)]).reshape(-1)
    for dt in (torch.int32, torch.int64):
        got = expert_blocks(ids.to(dt), e, bm, kernel=True)
        assert torch.equal(got, expert_groups_ref(ids, e, bm)), (t, a, e, bm, dt)
    one = torch.full((2100,), 3)
    assert torch.equal(expert_blocks(one, 8, 64, kernel=True), expert_groups_ref(one, 8, 64))


@pytest.mark.gpu
def test_gpu_expert_blocks_kernel() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(5)
    for t, a, e, bm in [(2048, 8, 256, 64), (4096, 16, 56, 128), (33, 4, 9, 16)]:
        ids = torch.randint(-3, e + 3, (t * a,), generator=g)
        got = expert_blocks(ids.cuda(), e, bm)
        assert torch.equal(got.cpu(), expert_groups_ref(ids, e, bm)), (t, a, e, bm)


def test_expert_blocks_one_expert_takes_every_pick() -> None:
    ids = torch.full((100,), 3)
    grp = expert_blocks(ids, 8, 16)
    assert torch.equal(grp, expert_groups_ref(ids, 8, 16))
    assert grp[:7, 0].tolist() == [3] * 7 and (grp[7:, 0] == -1).all()


def test_expert_blocks_refuses_bad_ids() -> None:
    with pytest.raises(ValueError, match="ids must be int32/int64"):
        expert_blocks(torch.zeros(4), 4, 8)
    with pytest.raises(ValueError, match="bm=0"):
        expert_blocks(torch.zeros(4, dtype=torch.long), 4, 0)


def test_triton_kernels_in_interpreter() -> None:
    run_interp_tests_in_child(__file__, expected_passed=14)


@interp_only
@pytest.mark.parametrize(
    "m, n, k, dtype, per_row, bias",
    [
        (5, 40, 208, torch.float32, False, False),  # K pads to 256, N to 48, M < BM
        (70, 24, 128, torch.float32, True, True),  # two M tiles, per-row global scale, bias
        (3, 17, 144, torch.float16, True, False),  # (the interpreter's tl.join drops bf16 values)
    ],
)  # fmt: skip
def test_interp_dense_odd_shapes(poison_empty, m, n, k, dtype, per_row, bias) -> None:
    _dense_case(m, n, k, dtype, "cpu", per_row, bias)


@interp_only
@pytest.mark.parametrize(
    "t, a, e, bm, skew",
    [(6, 3, 5, 4, "random"), (20, 1, 3, 8, "one"), (5, 2, 7, 16, "random")],
)
def test_interp_grouped(t, a, e, bm, skew) -> None:
    _grouped_case(t, a, e, 32, 256, bm, torch.float32, "cpu", skew)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 100, 256, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dense(poison_empty, m: int, dtype: torch.dtype) -> None:
    _dense_case(m, 200, 336, dtype, "cuda", per_row=m % 2 == 0, bias=m == 100)
    _dense_case(m, 1024, 1024, dtype, "cuda", per_row=False, bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t, a, e, bm, skew",
    [(33, 4, 9, 16, "random"), (200, 8, 32, 64, "random"), (150, 2, 5, 64, "one"), (64, 8, 64, 32, "random")],
)
def test_gpu_grouped(t: int, a: int, e: int, bm: int, skew: str) -> None:
    _grouped_case(t, a, e, 256, 384, bm, torch.bfloat16, "cuda", skew)


def _compile_sm90(
    bm: int, bn: int, warps: int, stages: int, k: int, grouped: bool, dtype: str, gated: int = 0
):
    """The tile kernel compiled for sm_90 on this machine's Triton (no GPU needed)."""
    import inspect

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3run.kernels.nvfp4_gemm import tile

    kern = tile._tile_gemm_kernel
    consts = dict(
        K=k, K_PAD=-(-k // 128) * 128, BM=bm, BN=bn, GROUP_M=8, GROUPED=grouped, PER_COL_GS=grouped,
        HAS_BIAS=not grouped, ASM=tile.word_asm(dtype), OUT_SCALE=tile.SHIFT_OUT_SCALE, DOT_PRECISION="tf32",
        GATED=gated, BETA=4.0 if gated == 2 else 0.0, LINEAR_BETA=25.0 if gated == 2 else 0.0,
    )  # fmt: skip
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", b_ptr=f"*{dtype}", y_ptr=f"*{dtype}",
        grp_ptr="*i32", M="i32", N="i32", N_PAD="i32", stride_xm="i32", stride_ym="i32", x_div="i32",
        w_estride="i64", s_estride="i64", gs_estride="i32",
    )  # fmt: skip
    order = list(inspect.signature(kern.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    # what the runtime specialises for torch tensors: 16-byte aligned pointers and strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    src = ASTSource(kern, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


@pytest.mark.parametrize(
    "rows, n, k, grouped, dtype, gated",
    [
        (4096, 7168, 7168, False, "bf16", 0), (256, 12288, 7168, False, "fp16", 0),
        (64, 2048, 2304, True, "bf16", 0), (64, 2048, 2304, True, "bf16", 2),
        (64, 6144, 3584, True, "fp16", 1),
    ],
)  # fmt: skip
def test_launches_compile_for_sm90_on_wgmma(
    rows: int, n: int, k: int, grouped: bool, dtype: str, gated: int
) -> None:
    """The default launches build for sm_90 with this machine's Triton and issue wgmma with the decoded
    weights as the register operand (a decoded tile as the shared-memory operand broke Triton 3.6's
    dot-operand pass)."""
    from k3run.kernels.nvfp4_gemm.tile import DEFAULT_GROUPED_CONFIG, tile_config

    if grouped:
        bm, (bn, warps, stages) = 64, DEFAULT_GROUPED_CONFIG
    else:
        bm, bn, warps, stages = tile_config(rows, n, k)
    ptx = _compile_sm90(bm, bn, warps, stages, k, grouped, dtype, gated).asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16|f16)\.(bf16|f16) +\{", ptx)


def _gated_case(
    t: int, a: int, e: int, i: int, k: int, bm: int, act: tuple, device: str, dtype: torch.dtype, fn=None
):
    """GEMM1 with the activation in the epilogue against the same GEMM without it plus the activation of
    layers/activation.py on the stored halves: equal up to the activation's fp32 evaluation (tanh, sigmoid
    and exp implementations differ by a few fp32 ulps, bounded here by 16 u |h|) and the one rounding of h to
    `dtype`, where two fp32 values on either side of a midpoint may round apart (one ulp)."""
    from k3run.kernels.nvfp4_gemm.tile import nvfp4_tile_gemm_grouped
    from k3run.layers.activation import GatedActivation

    fn = fn or nvfp4_tile_gemm_grouped
    g = torch.Generator().manual_seed(t + i)
    ids = torch.stack([torch.randperm(e + 2, generator=g)[:a] - 1 for _ in range(t)]).reshape(-1).to(device)
    ws, ss, gss = [], [], []
    for j in range(e):
        w, s, gs = _random_nvfp4(2 * i, k, device, per_row=True, seed=j + 100)
        tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
        ws.append(tw.weight)
        ss.append(tw.scale_bits)
        gss.append(gs)
    weight, scale, gsn = torch.stack(ws), torch.stack(ss), torch.stack(gss).contiguous()
    x = (torch.randn(t, k, generator=g) * 0.5).to(device).to(dtype)
    grp = expert_blocks(ids, e, bm)
    kw = dict(picks=t * a, x_div=a, k=k)
    gu = fn(x, weight, scale, gsn, grp, **kw)
    kind, beta, lbeta = act
    ref = GatedActivation(kind, beta, lbeta).on_halves(gu[:, :i], gu[:, i:])
    out = fn(x, weight, scale, gsn, grp, activation=act, **kw)
    hit = ((ids >= 0) & (ids < e)).cpu()
    ref, out = ref.cpu()[hit], out.cpu()[hit]
    assert_within(
        f"gated {act} t={t} e={e} {dtype}", ref, out, 16 * FP32_U * ref.abs() + output_ulp(ref, dtype)
    )


@interp_only
@pytest.mark.parametrize("act", [("silu", None, None), ("situ", 4.0, 25.0), ("situ", 2.0, None)])
def test_interp_gated_epilogue(act) -> None:
    _gated_case(9, 2, 3, 32, 128, 8, act, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("silu", None, None), ("situ", 4.0, 25.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_epilogue(act, dtype: torch.dtype) -> None:
    _gated_case(150, 4, 6, 256, 512, 64, act, "cuda", dtype)
