"""The stream-K form of the routed experts' expert-major decode launch (kernels/nvfp4_gemm/expert_stream.py):
compiled for sm_90 on the CPU (it must build, issue mma.sync and cp.async, keep the loop free of spills, and
place its PDL wait where its table's age allows), and on a GPU against the expert-major launch and the fp32
reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from k3run.testing import RTOL, assert_close

stream = pytest.importorskip("k3run.kernels.nvfp4_gemm.expert_stream")
triton = pytest.importorskip("triton")


def _compile(bt: int, k: int, stages: int, act: int, early: bool, pdl: bool = True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k3run.kernels.nvfp4_gemm import gluon_gemv as gemv

    mma, la, lw4, lb, lcw, _, smem = gemv.async_layouts(1, bt)
    consts = dict(
        K=k, K_PAD=-(-k // 128) * 128, NB=144, PER_COL_GS=False, BT=bt, STAGES=stages, G_BLOCK=64,
        ASM=gemv._TILED_ASM_BF16, SCALE_ASM=gemv._SCALE_WORD_ASM_BF16, MMA=mma, LA=la, LW4=lw4, LB=lb,
        LCW=lcw, SMEM=smem, LSW=gemv.scale_word_layout(1, bt), OUT_SCALE=gemv.SHIFT_OUT_SCALE, PDL=pdl,
        EARLY=early, ACT=act,
    )  # fmt: skip
    ptrs = dict(
        x_ptr="*bf16", w_ptr="*i32", s_ptr="*i32", gs_ptr="*fp32", y_ptr="*bf16", ws_ptr="*fp32",
        cnt_ptr="*i32", tab_ptr="*i32", grp_ptr="*i32", n_groups="i32", N="i32", stride_xm="i32",
        stride_ym="i32", slot_div="i32", w_estride="i64", s_estride="i64", gs_estride="i32",
        act_beta="fp32", act_rbeta="fp32", act_lbeta="fp32", act_rlbeta="fp32", half_n="i32",
    )  # fmt: skip
    kernel = stream._expert_stream_kernel
    order = list(inspect.signature(kernel.fn).parameters)
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order) if name.endswith("_ptr")}
    # what the runtime specialises for the Kimi / K3 shapes: strides and expert strides divisible by 16
    specialised = ("stride_xm", "stride_ym", "w_estride", "s_estride")
    attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in specialised})
    src = GluonASTSource(kernel, sig, {(order.index(c),): v for c, v in consts.items()}, attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "maxnreg": stream.STREAM_MAXNREG[bt]}
    )


@pytest.mark.parametrize(
    "bt, k, stages, act, early", [(8, 2304, 2, 2, False), (8, 1024, 2, 0, True), (16, 2304, 4, 1, False),
                                  (32, 3584, 3, 0, False), (8, 7168, 3, 3, True)],
)  # fmt: skip
def test_stream_launch_compiles_for_sm90_without_loop_spills(bt, k, stages, act, early):
    """GEMM1 with its activation (SiTU, SiLU, SiTU capped) and GEMM2 at Kimi Linear's and K3's widths, token
    tiles 8 / 16 / 32, rings of 2 to 4 slots: mma.sync and cp.async in the loop, the activation's exp, the
    boundary fix-up's acq_rel atomic, no local-memory traffic inside a loop; at 8 tokens at most 72
    registers (28 programs an SM); weight tiles copied 16 bytes a thread at a time."""
    from tests.kernels.test_nvfp4_gemv_compile import _assert_no_loop_spills, cubin_usage_and_sass

    ck = _compile(bt, k, stages, act, early)
    res, sass = cubin_usage_and_sass(ck)
    if bt == 8:
        assert int(res.split("REG:")[1].split()[0]) <= 72
    assert "LDGSTS.E.BYPASS.128" in sass
    ptx = ck.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert ("ex2.approx" in ptx) == bool(act)
    _assert_no_loop_spills(ck)


@pytest.mark.parametrize("bt", [8, 16, 32])
def test_stream_residency_table_never_oversubscribes_an_sm(bt: int):
    """STREAM_RESIDENT[bt] programs an SM fit at once at the registers ptxas takes under STREAM_MAXNREG
    (sm_90: 64K registers allocated 8 a thread at a time, 32 CTAs, 227 KB of shared memory), so the stream
    grid never leaves programs waiting for others to end (which would bring back the tail it removes)."""
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    fits = 32
    for k, act, early, stages in ((2304, 1, False, 3), (3072, 0, True, 3), (7168, 2, False, 4)):
        ck = _compile(bt, k, stages, act, early)
        regs = int(cubin_usage_and_sass(ck)[0].split("REG:")[1].split()[0])
        fits = min(fits, 65536 // (-(-regs // 8) * 8 * 32), 227 * 1024 // (ck.metadata.shared + 1024))
    assert stream.STREAM_RESIDENT[bt] <= fits, (bt, fits)


@pytest.mark.parametrize("early", [False, True])
def test_stream_launch_reads_its_table_early_only_when_told(early: bool):
    """One PDL wait: before the first global access (the group table) for GEMM1; after the table's loads
    and the first weight tiles' cp.async for GEMM2 (early_table)."""
    from tests.kernels.test_nvfp4_gemv_compile import assert_wait_placement

    assert_wait_placement(_compile(8, 2304, 2, 0, early).asm["ptx"], early)


# ---- on a GPU


def _case(n_exp: int, n: int, k: int, t: int, a: int, bt: int):
    from k3run.kernels.nvfp4_gemm.groups import expert_groups
    from tests.kernels.test_nvfp4_gemv_gpu import stacked_experts

    raw, w, s, gs, ids = stacked_experts(n_exp, n, k, t, a)
    return raw, w, s, gs, ids, expert_groups(ids, n_exp, bt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t, bt", [(1, 8), (3, 8), (8, 8), (20, 8), (40, 16), (75, 32)])
@pytest.mark.parametrize("stages", [2, 4])
def test_stream_matches_the_expert_major_launch(t: int, bt: int, stages: int):
    """Against nvfp4_gemv_by_expert on E = 5 experts, N = 520 (rows padded to 528: 33 row blocks), K = 3504
    (28 K tiles, the last partial), A = 4 picks a token, some of other ranks (zero rows), as GEMM1 (token
    rows, slot_div = A) and GEMM2 (pick rows). With one item a program (programs = the item count) the
    bits are the expert-major launch's; with fewer programs (items split between two, long ranges crossing
    many items) each split item is its two halves' fp32 partials added once, so the bound is the bf16
    output rounding (RTOL[bf16]) against the fp32 reference and one bf16 ulp (2^-7 relative) against the
    expert-major launch. A second call gives the same bits (the boundary counters were put back to 0)."""
    from k3run.kernels.nvfp4_gemm import nvfp4_linear_ref
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert

    n_exp, n, k, a = 5, 520, 3504, 4
    raw, w, s, gs, ids, grp = _case(n_exp, n, k, t, a, bt)
    items = int((grp[:, 0] >= 0).sum()) * 33
    x = torch.randn(t, k, device="cuda").bfloat16()
    xp = torch.randn(t * a, k, device="cuda").bfloat16()
    for xin, div in ((x, a), (xp, 1)):
        kw: dict = dict(picks=t * a, slot_div=div, rows=n)
        want = nvfp4_gemv_by_expert(xin, w, s, gs, grp, stages=stages, **kw)
        whole = nvfp4_gemv_by_expert(xin, w, s, gs, grp, programs=items, stages=stages, **kw)
        assert torch.equal(whole, want), (t, bt, div)
        kw["stages"] = stages
        for programs in (items - 1, max(1, items // 7), 3, 1, 4 * items):
            got = nvfp4_gemv_by_expert(xin, w, s, gs, grp, programs=programs, **kw)
            assert_close(f"stream {programs} programs vs expert-major", want, got, rtol=2.0**-7)
            again = nvfp4_gemv_by_expert(xin, w, s, gs, grp, programs=programs, **kw)
            assert torch.equal(got, again), programs
        for si, e in enumerate(ids.tolist()):
            if not 0 <= e < n_exp:
                assert not bool(got[si].any()), si
        si = next(i for i, e in enumerate(ids.tolist()) if 0 <= e < n_exp)
        ref = nvfp4_linear_ref(xin[si // div : si // div + 1].float(), *raw[int(ids[si])])
        assert_close("stream vs fp32 reference", ref, got[si : si + 1], rtol=RTOL[torch.bfloat16])
    bad: dict = dict(picks=t * a, slot_div=a, rows=n)
    with pytest.raises(ValueError, match="programs must be >= 1"):
        nvfp4_gemv_by_expert(x, w, s, gs, grp, programs=0, **bad)
    with pytest.raises(ValueError, match="groups"):
        nvfp4_gemv_by_expert(x, w, s, gs, grp[:, :5], programs=8, **bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", [("silu", 1.0, None), ("situ", 4.0, 25.0)])
def test_stream_gemm1_activation_matches_the_expert_major_launch(act):
    """GEMM1 with the gated activation in its epilogue (N = 2I = 512 rows, gate then up; K = 2304): with one
    item a program the bits of the expert-major launch; split items within one bf16 ulp of it."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert

    n_exp, n, k, t, a = 6, 512, 2304, 8, 4
    _, w, s, gs, _, grp = _case(n_exp, n, k, t, a, 8)
    items = int((grp[:, 0] >= 0).sum()) * (n // 16)
    x = torch.randn(t, k, device="cuda").bfloat16()
    kw = dict(picks=t * a, slot_div=a, rows=n, act=act)
    want = nvfp4_gemv_by_expert(x, w, s, gs, grp, **kw)
    assert want.shape == (t * a, n // 2)
    assert torch.equal(nvfp4_gemv_by_expert(x, w, s, gs, grp, programs=items, **kw), want)
    for programs in (items // 3, 5):
        got = nvfp4_gemv_by_expert(x, w, s, gs, grp, programs=programs, stages=3, **kw)
        assert_close(f"stream GEMM1 {act[0]} {programs} programs", want, got, rtol=2.0**-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stream_in_a_cuda_graph_follows_the_routing():
    """Captured once, replayed with other picks (another table, another used-group count): each replay
    matches the eager launch on its own picks (the used groups are read on the device, not at capture)."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import nvfp4_gemv_by_expert
    from k3run.kernels.nvfp4_gemm.groups import expert_groups

    n_exp, n, k, t, a = 7, 256, 1024, 8, 2
    _, w, s, gs, ids, _ = _case(n_exp, n, k, t, a, 8)
    x = torch.randn(t, k, device="cuda").bfloat16()
    static_ids = ids.clone()
    kw = dict(picks=t * a, slot_div=a, rows=n, programs=40)

    def step():
        grp = expert_groups(static_ids, n_exp, 8)
        return nvfp4_gemv_by_expert(x, w, s, gs, grp, **kw)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        new = torch.randint(0, 2 if seed == 0 else n_exp, (t * a,), generator=g).to(torch.int32)
        static_ids.copy_(new.cuda())
        graph.replay()
        want = nvfp4_gemv_by_expert(x, w, s, gs, expert_groups(static_ids, n_exp, 8), **kw)
        assert torch.equal(out, want), seed
