"""The Gluon NVFP4 decode kernel compiled for sm_90 on the CPU (no GPU needed): it must build with this
machine's Triton, put the decoded weights in the mma operand layout without moving data (the kernel's
`convert_layout(..., assert_trivial=True)` fails the compile otherwise), issue mma.sync, and fit its
register cap without spilling. The numbers it computes are checked on a GPU (test_nvfp4_gemv_gpu.py)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess

import pytest

gemv = pytest.importorskip("k3run.kernels.nvfp4_gemm.gluon_gemv")
triton = pytest.importorskip("triton")


def _compile(
    num_warps: int, bt: int, split_k: int, k: int, dtype: str, maxnreg: int, stages: int = 2,
    tiled: bool = False, pdl: bool = False, grouped: bool = False, byexp: bool = False, act: int = 0,
    early: bool = False, token_warps: int = 1,
):  # fmt: skip
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    asm = gemv._ASM_BF16 if dtype == "bf16" else gemv._ASM_FP16
    consts = dict(
        K=k, K_PAD=-(-k // 128) * 128, SPLIT_K=split_k, PER_COL_GS=False, HAS_BIAS=True, EVEN_N=False,
        BN=16 * num_warps, BT=bt, ASM=asm,
    )  # fmt: skip
    kernel = gemv._nvfp4_gemv_async_kernel
    mma, la, lw4, lb, lcw, lcs, smem = gemv.async_layouts(num_warps, bt, token_warps)
    if tiled:
        asm = gemv.tiled_word_decode_asm(dtype)
        scale_asm = gemv._SCALE_WORD_ASM_BF16 if dtype == "bf16" else gemv._SCALE_WORD_ASM_FP16
    else:
        scale_asm = gemv._SCALE_ASM_BF16 if dtype == "bf16" else gemv._SCALE_ASM
    out_scale = gemv.SHIFT_OUT_SCALE if tiled else 1.0
    consts.update(STAGES=stages, ASM=asm, SCALE_ASM=scale_asm, MMA=mma, LA=la, LW4=lw4, LB=lb, LCW=lcw)
    consts.update(
        LCS=lcs,
        SMEM=smem,
        TILED=tiled,
        OUT_SCALE=out_scale,
        PDL=pdl,
        LSW=gemv.scale_word_layout(num_warps, bt, token_warps),
        GROUPED=grouped or byexp,
        BYEXP=byexp,
        EARLY=early,
    )
    if not grouped and not byexp:
        consts.update(ids_ptr=None, n_experts=0, slot_div=1, w_estride=0, s_estride=0, gs_estride=0)
    if not byexp:
        consts["grp_ptr"] = None
    ptrs = dict(
        x_ptr=f"*{dtype}", w_ptr="*i32", s_ptr="*i32" if tiled else "*u8", gs_ptr="*fp32",
        b_ptr=f"*{dtype}", y_ptr=f"*{dtype}", ws_ptr="*fp32", cnt_ptr="*i32", tab_ptr="*i32", M="i32",
        N="i32", stride_xm="i32", stride_ym="i32", ids_ptr="*i64", n_experts="i32",
        slot_div="i32", w_estride="i64", s_estride="i64", gs_estride="i32", grp_ptr="*i32",
    )  # fmt: skip
    if act:  # GEMM1 with its activation: the betas and the up rows' offset are runtime arguments
        consts["ACT"] = act
        ptrs.update(act_beta="fp32", act_rbeta="fp32", act_lbeta="fp32", act_rlbeta="fp32", half_n="i32")
    params = inspect.signature(kernel.fn).parameters
    order = list(params)
    for name, par in params.items():  # experiment switches left at their defaults
        if name not in consts and name not in ptrs and par.default is not inspect.Parameter.empty:
            consts[name] = par.default
    sig = {name: ("constexpr" if name in consts else ptrs[name]) for name in order}
    # what the runtime specialises for torch tensors: 16-byte aligned pointers, strides divisible by 16
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(order)
        if name.endswith("_ptr") and name not in consts
    }
    if k % 16 == 0:
        attrs.update({(order.index(s),): [["tt.divisibility", 16]] for s in ("stride_xm", "stride_ym")})
    const_args = {(order.index(c),): v for c, v in consts.items()}
    src = GluonASTSource(kernel, sig, const_args, attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps * token_warps, "maxnreg": maxnreg},
    )


@pytest.mark.parametrize(
    "m, n, k, dtype", [(1, 7168, 7168, "bf16"), (16, 12288, 7168, "bf16"), (32, 520, 3600, "fp16")]
)
def test_default_gemv_launches_compile_for_sm90_without_spills(m: int, n: int, k: int, dtype: str):
    """The launches choose_config makes (token tiles 8 / 16 / 32, the cp.async kernel), at the register cap
    nvfp4_gemv passes."""
    from k3run.kernels.nvfp4_gemm import choose_config
    from k3run.kernels.nvfp4_gemm.triton import largest_divisor

    cfg = choose_config(m, n, k)
    assert cfg.gemv
    split_k = largest_divisor(-(-k // 128), cfg.split_k)  # what nvfp4_gemv launches
    # on sm_90 the default layout is tiled128 (the shift decoder for bf16)
    _check_compiled(m, k, dtype, cfg.num_warps, split_k, cfg.smem_stages, True, cfg.maxnreg)


@pytest.mark.parametrize("form", [(1, 2), (1, 4), (2, 2), (4, 2)])
def test_t32_forms_compile_for_sm90_within_their_register_table(form: tuple[int, int]):
    """K3RUN_GEMV_T32_FORM's 32-token launches (tiled128, PDL, K = 2304): each warp's mma count falls with its
    share of the token columns, no spills, and ptxas' registers are within one allocation step (8) of
    GEMV_T32_FORMS, which sizes the split."""
    from k3run.kernels.nvfp4_gemm.config import GEMV_T32_FORMS

    rows, tokens = form
    ck = _check_compiled(32, 2304, "bf16", rows, 2, 2, True, pdl=True, token_warps=tokens)
    one = _check_compiled(32, 2304, "bf16", rows, 2, 2, True, pdl=True)
    mma = re.compile(r"mma\.sync\.aligned\.m16n8k16")
    assert len(mma.findall(ck.asm["ptx"])) * tokens == len(mma.findall(one.asm["ptx"]))
    res, _ = cubin_usage_and_sass(ck)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    assert abs(regs - GEMV_T32_FORMS[form]) <= 8, regs


@pytest.mark.parametrize(
    "m, k, dtype, stages", [(1, 7168, "bf16", 4), (16, 3584, "fp16", 8), (32, 3600, "bf16", 2)]
)
def test_cp_async_gemv_compiles_for_sm90_without_spills(m: int, k: int, dtype: str, stages: int):
    """The kernel on split128 and on tiled128 at 2 to 8 slots: weights staged by cp.async, read back in the
    operand layout, no spills."""
    for tiled in (False, True):
        ck = _check_compiled(m, k, dtype, 1, 1, stages, tiled)
        assert "cp.async" in ck.asm["ptx"]


def _check_compiled(
    m: int, k: int, dtype: str, num_warps, split_k, stages, tiled=False, maxnreg=None, pdl=False,
    token_warps=1,
):  # fmt: skip
    bt = gemv.token_tile(m)
    maxnreg = maxnreg or gemv.MAXNREG[bt // token_warps]
    ck = _compile(
        num_warps, bt, split_k, k, dtype, maxnreg, stages, tiled, pdl=pdl, token_warps=token_warps
    )  # fmt: skip
    ptx = ck.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx
    # no shared-memory staging of the decoded tile: at most the split-K counter's broadcast touches smem
    assert len(re.findall(r"\bst\.shared", ptx)) <= 2, "the decoded weights went through shared memory"
    res, sass = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None, res
    regs, stack = int(use.group(1)), int(use.group(2))
    assert regs <= maxnreg, f"{regs} registers over the cap {maxnreg}"
    # a few spilled words outside the K loop cost nothing (ptxas 12.9+ at the 80-register cap of the 16-token
    # tile saves 16 bytes across the loop); a local-memory access inside it would cost every tile
    in_loop = _local_accesses_in_loops(sass)
    assert not in_loop, f"{stack} bytes of stack, spilled inside a loop: {in_loop}"
    return ck


def _local_accesses_in_loops(sass: str) -> list[str]:
    """The LDL / STL instructions between a backward branch and its target."""
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addr = [int(a, 16) for a, _ in code]
    found = []
    for a, ins in code:
        target = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) <= int(a, 16):
            lo, hi = int(target.group(1), 16), int(a, 16)
            found += [
                i for b, (_, i) in zip(addr, code) if lo <= b <= hi and re.match(r"(@!?P\w+\s+)?(LDL|STL)", i)
            ]
    return found


def test_grouped_gemv_compiles_for_sm90():
    """The routed-expert launch (nvfp4_gemv_grouped): expert id per pick, the wait before reading the ids."""
    ck = _compile(1, 8, 7, 3584, "bf16", gemv.MAXNREG[8], 2, True, True, grouped=True)
    ptx = ck.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1 and "mma.sync.aligned.m16n8k16" in ptx


@pytest.mark.parametrize("bt, stages", [(8, 2), (16, 2), (32, 2), (8, 3), (8, 4), (16, 3)])
def test_by_expert_gemv_compiles_for_sm90(bt: int, stages: int):
    """The expert-major routed-expert launch (nvfp4_gemv_by_expert): the group table read after the PDL wait,
    token rows gathered per column, unused groups returning before any copy; no spills in the loop, with
    the default ring of 2 slots and the deeper ones bench_expert_gemv.py --stages times."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import MAXNREG

    ck = _compile(1, bt, 7, 3584, "bf16", MAXNREG[bt], stages, True, True, byexp=True)
    ptx = ck.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1 and "mma.sync.aligned.m16n8k16" in ptx
    _assert_no_loop_spills(ck)


@pytest.mark.parametrize("byexp", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_grouped_gemv_reads_its_table_early_only_when_told(byexp: bool, early: bool):
    """The routed-expert launches wait (PDL) before their first global access, the ids or group table, unless
    EARLY (GEMM2: the table predates the launch before it): then the table loads and the first weight
    tiles' cp.async come before the one wait."""
    ck = _compile(1, 8, 1, 2304, "bf16", gemv.MAXNREG[8], 2, True, True, grouped=not byexp, byexp=byexp,
                  early=early)  # fmt: skip
    assert_wait_placement(ck.asm["ptx"], early)


def assert_wait_placement(ptx: str, early: bool) -> None:
    """One PDL wait; before it the table's loads and the first weight tiles' cp.async when early, no global
    access at all otherwise."""
    body = ptx.split(".entry", 1)[1]
    assert body.count("griddepcontrol.wait") == 1
    before = body[: body.index("griddepcontrol.wait")]
    if early:
        assert "ld.global" in before and "cp.async" in before
    else:
        assert "ld.global" not in before and "cp.async" not in before


@pytest.mark.parametrize("act, bt, byexp", [(1, 8, True), (3, 16, True), (2, 32, True), (1, 8, False)])
def test_gemm1_with_its_activation_compiles_for_sm90(act: int, bt: int, byexp: bool):
    """An expert's GEMM1 with the gated activation in its epilogue (ACT: SiLU, SiTU, SiTU with the up half
    capped), expert-major and one pick a program: gate and up meet through shared memory (a store besides
    the weight ring's cp.async), exp in the epilogue, no spills in the loop."""
    from k3run.kernels.nvfp4_gemm.gluon_gemv import MAXNREG

    ck = _compile(1, bt, 7, 2304, "bf16", MAXNREG[bt], 2, True, True, grouped=not byexp, byexp=byexp, act=act)
    ptx = ck.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and re.search(r"\bst\.shared|\bstmatrix", ptx)
    assert "ex2.approx" in ptx  # the sigmoid's exp
    _assert_no_loop_spills(ck)


def _assert_no_loop_spills(ck) -> None:
    assert not _local_accesses_in_loops(cubin_usage_and_sass(ck)[1])


def cubin_usage_and_sass(ck) -> tuple[str, str]:
    """(cuobjdump -res-usage, cuobjdump -sass) of a compiled kernel; skips where Triton ships no cuobjdump."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("no cuobjdump in this Triton build to read the resource use")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"k3run_cubin_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(ck.asm["cubin"])
    try:
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True)
    finally:
        os.remove(path)
    return res.stdout, sass.stdout
