"""The decode step's small Triton kernels compiled for sm_90 on the CPU (no GPU needed), with and without
programmatic dependent launch (kernels/pdl.py): each builds, and with PDL its first instructions are the
grid-dependency wait and the early launch of the next kernel, before any global load, store or atomic (so it
reads and writes nothing the previous kernel may still be writing or reading); without PDL there is neither.
What the kernels compute is checked by their interpreter and GPU tests."""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")

_MEMORY = re.compile(r"\b(ld|st|atom|red)\.(global|shared)|\bcp\.async")


def _kernels():
    from k3run.kernels.kda import conv
    from k3run.kernels.mla import triton as mla
    from k3run.kernels.moe_ops import triton as moe
    from k3run.kernels.norm import triton as norm
    from k3run.kernels.nvfp4_gemm import groups

    f32 = dict(eps="fp32", scale="fp32", beta="fp32", rbeta="fp32", lbeta="fp32", rlbeta="fp32")
    mla_ptrs = dict(q_ptr="*fp32", o_ptr="*fp32", lse_ptr="*fp32", slots_ptr="*i64", ctx_ptr="*i64")
    return {
        "rms_norm": (norm._rms_norm_kernel, "bf16", f32,
                     dict(HAS_GATE=False, HAS_RES=True, BLOCK_R=1, BLOCK_D=4096)),
        "rms_norm with the MoE's combine": (norm._rms_norm_kernel, "bf16", {**f32, "cw_ptr": "*fp32"},
                                            dict(HAS_GATE=False, HAS_RES=True, BLOCK_R=1, BLOCK_D=4096, A=9,
                                                 HAS_ADD=True)),
        "gated rms_norm": (norm._rms_norm_kernel, "fp32", f32,
                           dict(HAS_GATE=True, HAS_RES=False, BLOCK_R=16, BLOCK_D=128)),
        "attn_res_mix": (norm._attn_res_mix_kernel, "bf16", f32, dict(BLOCK_N=4, BLOCK_D=4096)),
        "router partials": (moe._router_partials_kernel, "fp32", f32, dict(BE=8, BD=256, BT=1)),
        "top-k": (moe._sigmoid_topk_kernel, "fp32", f32,
                  dict(A=8, EXTRA=1, RENORM=True, BLOCK_A=8, BLOCK_E=256, LIB=True)),
        "router in one launch": (moe._router_one_launch_kernel, "fp32", f32,
                                 dict(BE=8, BD=256, BT=1, A=8, EXTRA=1, RENORM=True, BLOCK_A=8, BLOCK_E=256,
                                      TB=1, LIB=True)),
        "gated": (moe._gated_kernel, "bf16", f32, dict(SITU=True, CAP_UP=True, BLOCK=1024, LIB=True)),
        "combine": (moe._combine_kernel, "bf16", f32, dict(A=9, HAS_ADD=False, BLOCK=1024)),
        "conv decode": (conv._conv_decode_kernel, "bf16", f32,
                        dict(W=4, BLOCK_C=512, ZERO_REC=True, ZBLOCK=1024)),
        "MLA decode splits": (mla._mla_decode_split_kernel, "bf16", {**f32, **mla_ptrs},
                              dict(L=512, R=64, BLOCK_H=32, BLOCK_N=64, IEEE=False)),
        "MLA merge": (mla._mla_merge_kernel, "fp32", f32, dict(L=512, BLOCK_S=8)),
        "expert_groups": (groups._expert_groups_kernel, "i64", f32,
                          dict(BT=16, BLOCK_P=64, BLOCK_E=512, BLOCK_G=64, BLOCK_C=32)),
    }  # fmt: skip


def _ptx(kernel, dtype: str, scalars: dict[str, str], consts: dict[str, object], pdl: bool) -> str:
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
            sig[name] = (
                f"*{dtype}"
                if name in ("x_ptr", "y_ptr", "out_ptr", "v_ptr", "s_ptr", "r_ptr")
                else ("*i32" if name in ("cnt_ptr", "grp_ptr", "first_ptr", "rank_ptr") else f"*{dtype}")
            )
        else:
            sig[name] = scalars.get(name, "i32")
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))
    return compiled.asm["ptx"]


@pytest.mark.parametrize("name", list(_kernels()))
def test_pdl_waits_before_any_memory_access(name: str) -> None:
    kernel, dtype, scalars, consts = _kernels()[name]
    body = _ptx(kernel, dtype, scalars, consts, pdl=True).split(".entry", 1)[1]
    wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    first = _MEMORY.search(body)
    assert wait >= 0 and launch > wait, f"{name}: no grid-dependency wait and launch"
    assert first is not None and first.start() > launch, (
        f"{name}: {first.group(0) if first else ''} before the wait"
    )
    assert "griddepcontrol" not in _ptx(kernel, dtype, scalars, consts, pdl=False), (
        f"{name}: PDL off still waits"
    )
