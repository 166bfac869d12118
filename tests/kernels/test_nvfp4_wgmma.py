"""The NVFP4 wgmma GEMM (kernels/nvfp4_gemm/wgmma.py) against the fp32 reference, and its sm_90 compile on
the CPU.

Error bound (elementwise, from the dtypes; the argument of test_nvfp4_tile.py): the decoded weights are exact
in 16-bit floats, so every product x_k * w_k is exact in fp32 and the kernel and the reference differ only in
the order of K fp32 additions (split-K adds one more level of fixed-order fp32 sums): |out - ref| <=
3 K u (|x| @ |W|^T) |gs| + one output ulp (the single rounding to the 16-bit output dtype).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from k3run.formats import dequantize_nvfp4
from k3run.kernels.nvfp4_gemm import prepare_nvfp4_weight
from tests.kernels.test_nvfp4_tile import _bound, _random_nvfp4

wg = pytest.importorskip("k3run.kernels.nvfp4_gemm.wgmma")


def _case(m, n, k, dtype, per_row, bias, config=None, seed=0):
    from k3run.testing import assert_within

    w, s, gs = _random_nvfp4(n, k, "cuda", per_row, seed=seed + m * 7 + n + k)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    out = wg.nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, k, n, b, config=config)
    wd = dequantize_nvfp4(w, s, 1.0, dtype=torch.float32)
    ref = (x.float() @ wd.t()) * gs.reshape(1, -1)
    if b is not None:
        ref = ref + b.float()
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within(f"wgmma gemm {m}x{n}x{k} {dtype} {config}", ref, out, _bound(x, wd, gs, ref, dtype))


def _need_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 100, 255, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_odd_shapes(poison_empty, m: int, dtype: torch.dtype) -> None:
    """Odd M (token tiles with rows past M), N not a multiple of the row block (200: padded to 208 rows,
    the last program past them), K = 336 (pads to 384: the K tail masked), per-row scales and a bias."""
    _need_sm90()
    _case(m, 200, 336, dtype, per_row=m % 2 == 0, bias=m in (17, 255))
    _case(m, 1024, 1024, dtype, per_row=False, bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [(64, 16, 1, 3), (128, 32, 2, 5), (64, 64, 3, 4), (128, 128, 2, 5), (64, 32, 6, 3), (128, 256, 1, 3)],
)
def test_gpu_configs(poison_empty, config) -> None:
    """Program shapes the launcher may take over K of 6 chunks: split-K (fixed-order partial sums) with 3, 2
    and 1 chunk per program (a ring deeper than the program's chunks is refused: its prologue would commit
    empty copy groups), both warp counts, token tiles 16..256."""
    _need_sm90()
    _case(150, 328, 720, torch.bfloat16, per_row=True, bias=True, config=config)


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic() -> None:
    """The last program of a tile sums the partials in a fixed order: two runs give the same bits."""
    _need_sm90()
    w, s, gs = _random_nvfp4(512, 2048, "cuda", False, seed=3)
    tw = prepare_nvfp4_weight(w, s, gs, layout="tiled128")
    x = torch.randn(40, 2048, device="cuda").to(torch.bfloat16)
    cfg = (128, 64, 8, 4)
    y1 = wg.nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 512, config=cfg)
    y2 = wg.nvfp4_wgmma_gemm(x, tw.weight, tw.scale_bits, tw.global_scale, 2048, 512, config=cfg)
    assert torch.equal(y1, y2)


def test_refuses_bad_input_and_config() -> None:
    w = torch.zeros(32, 64, dtype=torch.uint8)
    s = torch.zeros(32, 8, dtype=torch.uint8)
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        wg.nvfp4_wgmma_gemm(torch.zeros(4, 128), w, s, gs, 128, 32)
    with pytest.raises(ValueError, match="sm_90"):
        wg.nvfp4_wgmma_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), w, s, gs, 128, 32)


def test_rs_columns_is_the_register_order() -> None:
    """Position 16b + 8p + 2t + e of each 64-column half holds column 16t + 4b + 2p + e."""
    x = torch.arange(2 * 256, dtype=torch.float32).reshape(2, 256)
    y = wg.rs_columns(x)
    for pos in range(256):
        half, r = divmod(pos, 64)
        b, p, t, e = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
        assert y[1, pos] == x[1, half * 64 + 16 * t + 4 * b + 2 * p + e]


@pytest.mark.parametrize(
    "m, n, k", [(1, 7168, 7168), (64, 7168, 7168), (256, 12288, 7168), (4096, 7168, 12288)]
)
def test_config_fits_shared_memory_and_divides_k(m: int, n: int, k: int) -> None:
    bn, bt, split, stages = wg.wgmma_config(m, n, k)
    assert bn in (64, 128) and bt >= min(m, 128) and (k // 128) % split == 0
    assert 3 <= stages <= k // 128 // split + 2 and wg.smem_bytes(bn, bt, stages) <= 227 * 1024


def _compile(bn: int, bt: int, split: int, stages: int, k: int, dtype: str):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3run.kernels.nvfp4_gemm.tile import word_asm

    triton = pytest.importorskip("triton")
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps = wg.layouts(bn, bt)
    consts = dict(
        K_PAD=-(-k // 128) * 128, BN=bn, BT=bt, SPLIT_K=split, STAGES=stages, PER_COL_GS=True, HAS_BIAS=True,
        ASM=word_asm(dtype), OUT_SCALE=128.0, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw,
        LCS=lcs, PS=ps,
    )  # fmt: skip
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", b_ptr=f"*{dtype}", y_ptr=f"*{dtype}",
        ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", N_PAD="i32", stride_xm="i32", stride_ym="i32",
        nch="i32",
    )  # fmt: skip
    order = list(inspect.signature(wg._wgmma_kernel.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    src = GluonASTSource(wg._wgmma_kernel, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": bn // 16})


@pytest.mark.parametrize(
    "bn, bt, split, stages, k, dtype",
    [(128, 128, 1, 5, 7168, "bf16"), (64, 32, 1, 8, 3600, "fp16"), (128, 16, 2, 8, 2304, "bf16")],
)
def test_compiles_for_sm90_with_async_wgmma_and_no_spills(bn, bt, split, stages, k, dtype) -> None:
    """Two async wgmma per chunk from registers, waited down to the newest chunk's (not to zero) inside the
    loop, no shared-memory store inside the K loop (the decoded words land in the operand registers), and no
    local memory."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    ck = _compile(bn, bt, split, stages, k, dtype)
    ptx = ck.asm["ptx"]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bt}k16\.f32\.(bf16|f16)\.(bf16|f16) \{{", ptx)
    assert "wgmma.wait_group.sync.aligned 2;" in ptx
    res, sass = cubin_usage_and_sass(ck)
    assert _stores_in_loops(sass) == 0
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res


def _stores_in_loops(sass: str) -> int:
    """STS instructions inside the kernel's backward-branch ranges (its K loops)."""
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ranges = []
    for a, ins in code:
        target = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) <= int(a, 16):
            ranges.append((int(target.group(1), 16), int(a, 16)))
    return sum(
        1
        for a, ins in code
        if any(lo <= int(a, 16) <= hi for lo, hi in ranges) and re.match(r"(@!?P\w+\s+)?STS", ins)
    )


# ---- grouped experts (nvfp4_wgmma_grouped): the tile GEMM's grouped cases and bounds ----


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t, a, e, bt, skew",
    [(33, 4, 9, 16, "random"), (200, 8, 32, 64, "random"), (150, 2, 5, 64, "one"), (64, 8, 64, 32, "random"),
     (700, 6, 7, 128, "random"), (300, 8, 3, 256, "one")],
)  # fmt: skip
def test_gpu_grouped(t: int, a: int, e: int, bt: int, skew: str) -> None:
    """Experts with no picks, one expert taking every pick, other ranks' picks, blocks of 16..256 picks; K =
    384 (three chunks) and K = 336 (padded to 384)."""
    from tests.kernels.test_nvfp4_tile import _grouped_case

    _need_sm90()
    _grouped_case(t, a, e, 256, 384, bt, torch.bfloat16, "cuda", skew, fn=wg.nvfp4_wgmma_grouped)
    _grouped_case(t, a, e, 208, 336, bt, torch.float16, "cuda", skew, fn=wg.nvfp4_wgmma_grouped)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("silu", None, None), ("situ", 4.0, 25.0), ("situ", 2.0, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bt", [32, 128])
def test_gpu_grouped_gated_epilogue(act, dtype: torch.dtype, bt: int) -> None:
    """GEMM1's activation epilogue against the same launch without it + layers/activation.py on its halves
    (the bound of test_nvfp4_tile._gated_case); I = 240 (not a multiple of the 64 output columns a program
    owns: the last program's rows past the gate half re-read real rows, never stored)."""
    from tests.kernels.test_nvfp4_tile import _gated_case

    _need_sm90()
    _gated_case(150, 4, 6, 256, 512, bt, act, "cuda", dtype, fn=wg.nvfp4_wgmma_grouped)
    _gated_case(90, 3, 5, 240, 384, bt, act, "cuda", dtype, fn=wg.nvfp4_wgmma_grouped)


def test_grouped_refuses_bad_input() -> None:
    w = torch.zeros(2, 64, 64, dtype=torch.uint8)
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    gs = torch.ones(2, 1)
    grp = torch.zeros(1, 17, dtype=torch.int32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        wg.nvfp4_wgmma_grouped(torch.zeros(4, 128), w, s, gs, grp, picks=4, x_div=1, k=128)
    with pytest.raises(ValueError, match="sm_90"):
        x = torch.zeros(4, 128, dtype=torch.bfloat16)
        wg.nvfp4_wgmma_grouped(x, w, s, gs, grp, picks=4, x_div=1, k=128)


def _compile_grouped(r: int, bt: int, stages: int, k: int, gated: int, dtype: str):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3run.kernels.nvfp4_gemm.tile import word_asm

    triton = pytest.importorskip("triton")
    lw, lw2, lx, acc, la, lo, xs, lcw, lcs, ps, l3 = wg.grouped_layouts(r, bt, bool(gated))
    consts = dict(
        K_PAD=-(-k // 128) * 128, R=r, BT=bt, STAGES=stages, PER_COL_GS=True, GATED=gated,
        BETA=4.0 if gated == 2 else 0.0, LINEAR_BETA=25.0 if gated == 2 else 0.0, ASM=word_asm(dtype),
        OUT_SCALE=128.0, LW=lw, LW2=lw2, LX=lx, ACC=acc, LA=la, LO=lo, XS=xs, LCW=lcw, LCS=lcs, PS=ps, L3=l3,
    )  # fmt: skip
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", y_ptr=f"*{dtype}", grp_ptr="*i32",
        N_OUT="i32", N_ROWS="i32", stride_xm="i32", stride_ym="i32", x_div="i32", w_estride="i32",
        s_estride="i32", gs_estride="i32", nch="i32",
    )  # fmt: skip
    kern = wg._wgmma_grouped_kernel
    order = list(inspect.signature(kern.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    src = GluonASTSource(kern, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": r // 16})


@pytest.mark.parametrize(
    "r, bt, stages, k, gated, dtype",
    [(128, 64, 5, 2304, 1, "bf16"), (128, 128, 5, 3072, 2, "fp16"), (64, 32, 4, 1024, 0, "bf16")],
)
def test_grouped_compiles_for_sm90_with_async_wgmma_and_no_spills(r, bt, stages, k, gated, dtype) -> None:
    """The grouped kernel: async wgmma from registers waited down to the newest chunk's, x rows gathered by
    16-byte cp.async, no shared-memory store in the K loop, no local memory."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    ck = _compile_grouped(r, bt, stages, k, gated, dtype)
    ptx = ck.asm["ptx"]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bt}k16\.f32\.(bf16|f16)\.(bf16|f16) \{{", ptx)
    assert "wgmma.wait_group.sync.aligned 2;" in ptx
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx)
    assert copies and "0x10" in copies, copies[:4]
    res, sass = cubin_usage_and_sass(ck)
    assert _stores_in_loops(sass) == 0
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None and int(use.group(2)) == 0, res
