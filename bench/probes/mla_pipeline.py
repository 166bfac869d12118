"""Question: does the MLA decode split kernel's loop overlap a block's cache loads with the previous block's
dots? Compiled for sm_90 with this machine's Triton (no GPU needed), per launch form: registers, local
stack, shared memory, the K loop's SASS length, and the cp.async wait inside it (`DEPBAR.LE SB0, n`: n
commit groups may stay in flight while a block is computed; each block commits two groups, its latents and
its RoPE keys, so n = 0 means every block waits for its own loads with nothing ahead).

    PYTHONPATH=src:. python3 bench/probes/mla_pipeline.py [--forms 8/2/64,8/3/64,4/2/64,4/3/32]

Forms are warps/stages/block_n at 32-head blocks. Answer (Triton 3.9 on the CPU, session 56): with two
stages n = 0 at every form (no overlap within a program); three stages give n = 2 (one block ahead).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3run.kernels.mla.triton import _mla_decode_split_kernel
    from tests.kernels.test_nvfp4_gemv_compile import cubin_usage_and_sass

    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="8/2/64,8/3/64,4/2/64,4/3/32,4/3/64")
    args = ap.parse_args()
    kernel = _mla_decode_split_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    types = dict(q_ptr="*fp32", store_ptr="*bf16", slots_ptr="*i64", ctx_ptr="*i64", o_ptr="*fp32",
                 lse_ptr="*fp32", H="i32", SPLITS="i32", chunk="i32", window="i32", stride_slot="i64",
                 stride_pos="i32", scale="fp32")  # fmt: skip
    div16 = [n for n in params if n.endswith("_ptr") or n in ("stride_slot", "stride_pos")]
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in div16}
    print(f"triton {triton.__version__}, sm_90, bf16 cache, L 512, R 64, 32-head blocks")
    for form in args.forms.split(","):
        warps, stages, bn = (int(v) for v in form.split("/"))
        consts = dict(L=512, R=64, BLOCK_H=32, BLOCK_N=bn, IEEE=False, PDL=True)
        sig = {n: ("constexpr" if n in consts else types[n]) for n in params}
        src = ASTSource(kernel, sig, {(params.index(c),): v for c, v in consts.items()}, attrs)
        ck = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
        )
        res, sass = cubin_usage_and_sass(ck)
        use = re.search(r"REG:(\d+) STACK:(\d+)", res)
        lines = [re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line) for line in sass.splitlines()]
        code = [(int(m.group(1), 16), m.group(2).strip()) for m in lines if m]
        loop = next(
            ((int(t.group(1), 16), at) for at, ins in code if (t := re.search(r"BRA 0x([0-9a-f]+)", ins))
             and int(t.group(1), 16) < at),
            None,
        )  # fmt: skip
        waits = [ins for at, ins in code if loop and loop[0] <= at <= loop[1] and ins.startswith("DEPBAR.LE")]
        length = (loop[1] - loop[0]) // 16 + 1 if loop else 0
        print(
            f"{form:>9}: registers {use.group(1) if use else '?'}, stack {use.group(2) if use else '?'} B, "
            f"shared {ck.metadata.shared} B, loop {length} instructions, waits in it {waits}"
        )


if __name__ == "__main__":
    main()
