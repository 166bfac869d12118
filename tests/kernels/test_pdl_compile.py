"""The decode step's small Triton kernels compiled for sm_90 on the CPU (no GPU needed), with and without
programmatic dependent launch (kernels/pdl.py): each builds, and with PDL its first instructions are the
grid-dependency wait and the early launch of the next kernel, before any global load, store or atomic (so it
reads and writes nothing the previous kernel may still be writing or reading), except the loads of a
parameter's tile (the router's weight, MLA's W_UK / W_UV) or of the fused KDA decode's recurrent state;
without PDL there is neither.
What the kernels compute is checked by their interpreter and GPU tests."""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")

_MEMORY = re.compile(r"\b(ld|st|atom|red)\.(global|shared)|\bcp\.async")
# kernels that read a parameter (the router's fp32 weight tile, MLA's W_UK / W_UV tile, a norm module's
# weight) or a state no kernel of the step before them writes (the fused KDA decode's recurrent state block)
# before the wait, as the NVFP4 GEMVs stage their first weight tiles: there only global loads (and the CTA's
# own shared memory, where a tensor-core form stages the tile's parts) may precede it
_PREFETCH = {
    "rms_norm (a module's weight)",
    "KDA decode in one launch",
    "router partials",
    "router partials (dot)",
    "router in one launch",
    "MLA q absorb",
    "MLA o absorb",
    "MLA q absorb (dot)",
    "MLA o absorb (dot)",
}
# integer pointer arguments by name; every other pointer has the case's dtype
_INT_PTRS = {"cnt_ptr": "*i32", "grp_ptr": "*i32", "first_ptr": "*i32", "rank_ptr": "*i32", "id_ptr": "*i64",
             "io_ptr": "*i64", "slots_ptr": "*i64", "pos_ptr": "*i64"}  # fmt: skip


# the fused KDA decode's non-activation arguments: fp32 parameters and states, int64 indices, int32 counters
KDA_FUSED_SCALARS = dict(cw_ptr="*fp32", a_ptr="*fp32", dtb_ptr="*fp32", state_ptr="*fp32", ctx_ptr="*i64",
                         nw_ptr="*fp32", o_ptr="*fp32", lower_bound="fp32", scale="fp32", eps="fp32",
                         stride_c0="i64", stride_s0="i64")  # fmt: skip


def _kernels():
    from k3run.kernels.kda import conv, decode
    from k3run.kernels.mla import triton as mla
    from k3run.kernels.moe_ops import triton as moe
    from k3run.kernels.norm import triton as norm
    from k3run.kernels.nvfp4_gemm import groups
    from k3run.kernels.sampling import triton as sampling

    f32 = dict(eps="fp32", scale="fp32", beta="fp32", rbeta="fp32", lbeta="fp32", rlbeta="fp32")
    mla_ptrs = dict(q_ptr="*fp32", o_ptr="*fp32", lse_ptr="*fp32", slots_ptr="*i64", ctx_ptr="*i64")
    smp = dict(spec_ptr="*fp64", sum_ptr="*fp64", out_ptr="*i64")  # the float64 spec and sums, int64 tokens
    return {
        "rms_norm": (norm._rms_norm_kernel, "bf16", f32,
                     dict(HAS_GATE=False, HAS_RES=True, BLOCK_R=1, BLOCK_D=4096)),
        "rms_norm with the MoE's combine": (norm._rms_norm_kernel, "bf16", {**f32, "cw_ptr": "*fp32"},
                                            dict(HAS_GATE=False, HAS_RES=True, BLOCK_R=1, BLOCK_D=4096, A=9,
                                                 HAS_ADD=True)),
        "gated rms_norm": (norm._rms_norm_kernel, "fp32", f32,
                           dict(HAS_GATE=True, HAS_RES=False, BLOCK_R=16, BLOCK_D=128)),
        "rms_norm (a module's weight)": (norm._rms_norm_kernel, "bf16", {**f32, "cw_ptr": "*fp32"},
                                         dict(HAS_GATE=False, HAS_RES=True, BLOCK_R=1, BLOCK_D=4096, A=9,
                                              HAS_ADD=True, W_EARLY=True)),
        "attn_res_mix": (norm._attn_res_mix_kernel, "bf16", f32, dict(BLOCK_N=4, BLOCK_D=4096)),
        "router partials": (moe._router_partials_kernel, "fp32", f32, dict(BE=8, BD=256, BT=1)),
        "router partials (dot)": (moe._router_partials_kernel, "fp32", {**f32, "x_ptr": "*bf16"},
                                  dict(BE=16, BD=256, BT=16, DOT=True)),
        "top-k": (moe._sigmoid_topk_kernel, "fp32", f32,
                  dict(S=9, G=8, A=8, EXTRA=1, RENORM=True, BLOCK_A=8, BLOCK_E=256, LIB=True)),
        "router in one launch": (moe._router_one_launch_kernel, "fp32", f32,
                                 dict(BE=8, BD=256, BT=1, S=9, G=8, A=8, EXTRA=1, RENORM=True, BLOCK_A=8,
                                      BLOCK_E=256, TB=1, LIB=True)),
        "gated": (moe._gated_kernel, "bf16", f32, dict(SITU=True, CAP_UP=True, BLOCK=1024, LIB=True)),
        "combine": (moe._combine_kernel, "bf16", f32, dict(A=9, HAS_ADD=False, BLOCK=1024)),
        "conv decode": (conv._conv_decode_kernel, "bf16", f32,
                        dict(W=4, BLOCK_C=512, ZERO_REC=True, ZBLOCK=1024)),
        "KDA decode in one launch": (decode._kda_decode_fused_kernel, "bf16", KDA_FUSED_SCALARS,
                                     dict(W=4, WP=4, BK=128, BV=32, NV=4, LOWER=False)),
        "MLA decode splits": (mla._mla_decode_split_kernel, "bf16", {**f32, **mla_ptrs},
                              dict(L=512, R=64, BLOCK_H=32, BLOCK_N=64, IEEE=False)),
        "MLA merge": (mla._mla_merge_kernel, "fp32", f32, dict(L=512, BLOCK_S=8, BS=8, BL=128)),
        "MLA q absorb": (mla._mla_q_absorb_kernel, "fp32", f32,
                         dict(DN=128, L=512, R=64, BLOCK_DN=128, BL=32)),
        "MLA o absorb": (mla._mla_o_absorb_kernel, "fp32", f32, dict(DV=128, L=512, BV=8)),
        "MLA q absorb (dot)": (mla._mla_q_absorb_dot_kernel, "fp32", {**f32, "q_ptr": "*bf16"},
                               dict(DN=128, L=512, R=64, BLOCK_DN=128, BL=32, BB=32, QSPLIT=False, TC=True)),
        "MLA o absorb (dot)": (mla._mla_o_absorb_dot_kernel, "fp32", f32,
                               dict(DV=128, L=512, BV=16, BK=64, BB=16, TC=True)),
        "MLA latent store": (mla._mla_latent_store_kernel, "bf16", f32, dict(L=512, R=64)),
        "expert_groups": (groups._expert_groups_kernel, "i64", f32,
                          dict(BT=16, BLOCK_P=64, BLOCK_E=512, BLOCK_G=64, BLOCK_C=32)),
        "sampling chunk max": (sampling._chunk_max_kernel, "fp32", smp, dict(SCALED=False, C=4096)),
        "sampling chunk sums": (sampling._chunk_sum_kernel, "fp32", smp,
                                dict(SCALED=False, C=4096, BLOCK_NC=64, LIB=True)),
        "sampling pick": (sampling._pick_kernel, "fp32", smp,
                          dict(SCALED=True, C=4096, BLOCK_NC=64, LIB=True)),
    }  # fmt: skip


def _ptx(kernel, dtype: str, scalars: dict[str, str], consts: dict[str, object], pdl: bool) -> str:
    return _compile(kernel, dtype, scalars, consts, pdl).asm["ptx"]


def _compile(
    kernel, dtype: str, scalars: dict[str, str], consts: dict[str, object], pdl: bool, num_warps: int = 4
):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**consts, "PDL": pdl}
    sig = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if name not in consts and "constexpr" in str(param.annotation):
            consts[name] = param.default  # a constexpr left at its default
        if name in consts:
            sig[name] = "constexpr"
        elif name in scalars:
            sig[name] = scalars[name]
        elif name.endswith("_ptr"):
            sig[name] = _INT_PTRS.get(name, f"*{dtype}")
        else:
            sig[name] = scalars.get(name, "i32")
    return triton.compile(
        ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )


@pytest.mark.parametrize("name", list(_kernels()))
def test_pdl_waits_before_any_memory_access(name: str) -> None:
    kernel, dtype, scalars, consts = _kernels()[name]
    body = _ptx(kernel, dtype, scalars, consts, pdl=True).split(".entry", 1)[1]
    wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    assert wait >= 0 and launch > wait, f"{name}: no grid-dependency wait and launch"
    before = [m.group(0) for m in _MEMORY.finditer(body[:wait])]
    if name in _PREFETCH:
        # (shared memory is the CTA's own: a tile staged there for the tensor cores touches nothing else)
        assert "ld.global" in before and set(before) <= {"ld.global", "st.shared", "ld.shared"}, (
            f"{name}: before the wait {sorted(set(before))}"
        )
    else:
        assert not before, f"{name}: {before[0]} before the wait"
    first = _MEMORY.search(body, wait)
    assert first is not None and first.start() > launch, (
        f"{name}: {first.group(0) if first else ''} before the launch"
    )
    assert "griddepcontrol" not in _ptx(kernel, dtype, scalars, consts, pdl=False), (
        f"{name}: PDL off still waits"
    )


@pytest.mark.parametrize(
    "experts, top_k, splits, one_launch",
    [(256, 8, 9, False), (256, 8, 9, True), (896, 16, 28, False)],
)  # Kimi Linear's router (2304 columns, 256 experts) and K3's (7168, 896), as the launchers configure them
def test_router_kernels_compile_for_sm90_without_spills(
    experts: int, top_k: int, splits: int, one_launch: bool
):
    """The top-k sums `G` partial blocks' loads at once; with them and the keys in registers nothing may spill
    (K3's 1024 expert columns in one warp spilled 360 bytes, hence 4 warps there)."""
    from k3run.kernels.moe_ops import triton as moe
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    block_e = triton.next_power_of_2(experts)
    consts = dict(
        A=top_k, EXTRA=1, RENORM=True, BLOCK_A=triton.next_power_of_2(top_k), BLOCK_E=block_e, LIB=True
    )
    if one_launch:
        tb = max(1, min(4, 2048 // block_e))  # 4 tokens, the most the one-launch router takes at 256 experts
        kernel, warps = moe._router_one_launch_kernel, 4
        consts.update(BE=8, BD=256, BT=4, S=splits, G=moe._in_flight(tb * block_e // 128, splits), TB=tb)
    else:
        kernel, warps = moe._sigmoid_topk_kernel, max(1, block_e // 256)
        consts.update(S=splits, G=moe._in_flight(block_e // (32 * warps), splits))
    scalars = {"scale": "fp32"}
    compiled = _compile(kernel, "fp32", scalars, consts, pdl=True, num_warps=warps)
    res, _ = cubin_usage_and_sass(compiled)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None, res
    assert int(use.group(2)) == 0, f"{use.group(1)} registers and {use.group(2)} bytes of stack"


@pytest.mark.parametrize("be, bt, dot", [(8, 4, False), (16, 16, True)])
def test_router_partials_compile_for_sm90_without_spills(be: int, bt: int, dot: bool) -> None:
    """The broadcast form's [4, 8, 256] product and the dot form's [16, 256] bf16 token tile, its three
    [256, 16] bf16 weight parts and their [16, 16] fp32 product fit 128 threads, each with the next token
    block's x loaded ahead."""
    from k3run.kernels.moe_ops import triton as moe
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    scalars = {"x_ptr": "*bf16"} if dot else {}
    ck = _compile(moe._router_partials_kernel, "fp32", scalars, dict(BE=be, BD=256, BT=bt, DOT=dot), pdl=True)
    res, _ = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None, res
    assert int(use.group(2)) == 0, f"{use.group(1)} registers and {use.group(2)} bytes of stack"


def _kda_fused_usage(lower: bool, flat: bool, bv: int = 32, persist: bool = False) -> tuple[int, int]:
    """(registers, stack bytes) of the fused KDA decode for sm_90 at Kimi's head dim, BV 32 (or bv), 4
    warps, one program an item (or persistent programs)."""
    from k3run.kernels.kda import decode
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    consts = dict(W=4, WP=4, BK=128, BV=bv, NV=128 // bv, LOWER=lower, FLAT=flat, WK=512, WV=4 * bv,
                  PERSIST=persist)  # fmt: skip
    ck = _compile(decode._kda_decode_fused_kernel, "bf16", KDA_FUSED_SCALARS, consts, pdl=True)
    res, _ = cubin_usage_and_sass(ck)
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    assert use is not None, res
    return int(use.group(1)), int(use.group(2))


@pytest.mark.parametrize("lower", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_kda_fused_decode_compiles_for_sm90_without_spills(lower: bool, flat: bool) -> None:
    """At Kimi's head dim (128) a program's [128, 32] fp32 state block, its q / k / gate vectors and the
    window tiles fit 128 threads' registers (no stack), for both gate forms and both window shifts."""
    regs, stack = _kda_fused_usage(lower, flat)
    assert stack == 0, f"{regs} registers and {stack} bytes of stack"


@pytest.mark.parametrize("lower", [False, True])
def test_kda_fused_decode_persistent_form_compiles_for_sm90_without_spills(lower: bool) -> None:
    """The persistent form (K3RUN_KDA_FUSED_FORM .../pN) at BV 32: two state blocks a program (the one
    worked on, the next loading) still fit 4 warps' registers without stack, above the one-item program's
    (one more [128, 32] fp32 block: 32 registers a thread)."""
    regs, stack = _kda_fused_usage(lower, True, 32, persist=True)
    assert stack == 0, f"{regs} registers and {stack} bytes of stack"
    assert regs >= _kda_fused_usage(lower, True, 32)[0] + 32, regs


def test_kda_fused_decode_flat_shift_takes_fewer_registers() -> None:
    """The flat window shift keeps each window value in one thread, where the [channels, W - 1] block is
    replicated over the threads: fewer registers a thread at Kimi Linear's gate form (no lower bound)."""
    flat, _ = _kda_fused_usage(False, True)
    block, _ = _kda_fused_usage(False, False)
    assert flat < block, f"flat shift {flat} registers, block shift {block}"


_LOAD_BYTES = re.compile(r"ld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")


@pytest.mark.parametrize("flat", [False, True])
def test_kda_fused_decode_reads_only_its_state_before_the_wait(flat: bool) -> None:
    """With PDL the fused KDA decode reads its sequence's slot and context length (int64) and its [BK, BV]
    fp32 state block before the grid-dependency wait, and nothing else: the projections' outputs (qkv, f, b,
    gate) and the conv windows come after it. Counted as bytes a thread loads: 2 x 8 + BK BV 4 / 128 threads
    (the block is not replicated over threads at [128, 32] with 4 warps), whatever vector width the loads
    take."""
    from k3run.kernels.kda import decode

    consts = dict(W=4, WP=4, BK=128, BV=32, NV=4, LOWER=False, FLAT=flat, WK=512, WV=128)
    body = _ptx(decode._kda_decode_fused_kernel, "bf16", KDA_FUSED_SCALARS, consts, pdl=True)
    body = body.split(".entry", 1)[1]
    before = body[: body.index("griddepcontrol.wait")]
    loads = _LOAD_BYTES.findall(before)
    assert loads, "no load before the wait: the state block is read after it"
    per_thread = sum(int(v or 1) * int(bits) // 8 for v, bits in loads)
    assert per_thread == 2 * 8 + 128 * 32 * 4 // 128, f"{per_thread} bytes a thread before the wait"
