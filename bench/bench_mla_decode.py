"""Absorbed MLA decode attention (kernels/mla): the split-context Triton kernel against the fp32 windowed
reference it replaces in a static (CUDA-graph) decode step, at K3's widths (96 heads, latent 512, rope 64,
bf16 latent cache; --heads 32 for Kimi Linear's), on one GPU.

Per (batch, context): the window the graph decoder would use (the next power of two above the context, at
least 256); the time of the launch the engine makes (`decode_config`); its bytes (each sequence's cached
latents read once + queries + output) as TB/s and % of the device copy bandwidth, and its FLOPs as TFLOP/s
and % of a cuBLAS bf16 matmul, both ceilings measured in the same run (at 96 heads the tensor cores bind
first); the reference's time (the baseline), the speed-up and the relative RMS error against the reference.
Every sequence of a batch has the same context (no empty splits). --variants times other launch options.
Then the absorb kernels around the attention (`absorb_table`) against the torch chain, at 32 and 96 heads.
Timing: common.graph_ms (a graph of back-to-back calls; median).

    PYTHONPATH=src python bench/bench_mla_decode.py [--contexts 1024,8192,32768] [--batches 1,8,32]
        [--heads 96] [--absorb-only | --no-absorb] [--o-tiles 16/32/16,32/32/32]
"""

# every lambda below is timed immediately inside its loop iteration, so late binding is harmless
# ruff: noqa: B023

from __future__ import annotations

import argparse

import torch
from common import copy_bandwidth, graph_ms  # noqa: E402

from k3run.kernels.mla import mla_decode_ref
from k3run.kernels.mla.triton import mla_decode_triton
from k3run.testing import rel_rms_error

H, L, R = 96, 512, 64  # K3 MLA: heads, kv_lora_rank, qk_rope_head_dim
REF_MAX_BYTES = 24 << 30  # skip the reference where its fp32 window copies would exceed this


def _time(fn) -> float:
    return graph_ms([fn]) * 1e3  # us


def _mm_tflops(n: int = 8192) -> float:
    """cuBLAS bf16 n^3 matmul rate: the tensor-core ceiling."""
    mat = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _time(lambda: torch.mm(mat, mat)) / 1e6


def _window(ctx: int) -> int:
    w = 256
    while w <= ctx:
        w *= 2
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--variants",
        default="",
        help="block_h/block_n/warps/stages[/programs per SM[/fewest positions a split]], e.g. 32/64/4/2/4",
    )
    ap.add_argument("--heads", type=int, default=H, help="query heads (K3: 96, Kimi Linear: 32)")
    ap.add_argument("--absorb-only", action="store_true", help="only the absorb kernels' table")
    ap.add_argument("--no-absorb", action="store_true", help="skip the absorb kernels' tables")
    ap.add_argument(
        "--o-tiles",
        default="",
        help="the o absorb dot form's value/latent/sequence tiles[/warps] to time beside, e.g. "
        "16/32/16,16/64/16/8",
    )
    args = ap.parse_args()
    copy_tbs = copy_bandwidth()
    batches = [int(v) for v in args.batches.split(",")]
    o_tiles = [tuple(int(n) for n in v.split("/")) for v in args.o_tiles.split(",") if v]
    if args.absorb_only:
        print(f"{torch.cuda.get_device_name()}: copy bandwidth (read + write) {copy_tbs:.2f} TB/s")
        absorb_table(copy_tbs, batches, heads=32, o_tiles=o_tiles)  # Kimi Linear's MLA
        absorb_table(copy_tbs, batches, o_tiles=o_tiles)  # K3's
        return
    mm_tflops = _mm_tflops()
    heads = args.heads
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth (read + write) {copy_tbs:.2f} TB/s, "
        f"cuBLAS bf16 8192^3 {mm_tflops:.0f} TFLOP/s (the two ceilings; at {heads} heads the kernel does "
        f"{heads * (2 * L + R) * 2 / ((L + R) * 2):.0f} FLOP per cache byte, against the ceilings' "
        f"{mm_tflops / copy_tbs:.0f})"
    )
    variants = [s for s in args.variants.split(",") if s]
    head = f"{'B':>3} {'ctx':>6} {'window':>6} {'kernel us':>9} {'TB/s':>6} {'%copy':>6}"
    head += f" {'TFLOP/s':>7} {'%mm':>5}"
    head += f" {'ref us':>9} {'speed-up':>8} {'rel err':>8}"
    print(head + "".join(f" {v + ' us':>14}" for v in variants))
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in (int(v) for v in args.batches.split(",")):
        for ctx in (int(v) for v in args.contexts.split(",")):
            window = _window(ctx)
            store = torch.randn(b, window, L + R, device="cuda", generator=g).to(torch.bfloat16)
            slots = torch.randperm(b, device="cuda", generator=g)
            lens = torch.full((b,), ctx, dtype=torch.int64, device="cuda")
            q_lat = torch.randn(b, heads, L, device="cuda", generator=g) / L**0.5
            q_pe = torch.randn(b, heads, R, device="cuda", generator=g) / R**0.5
            scale = 1.0 / (128 + R) ** 0.5

            def kern(spec: str = ""):
                args = (q_lat, q_pe, store, slots, lens, window, scale)
                if not spec:  # what the engine launches (decode_config)
                    return mla_decode_triton(*args)
                nums = [int(v) for v in spec.split("/")]
                kw = dict(block_h=nums[0], block_n=nums[1], num_warps=nums[2], num_stages=nums[3])
                kw.update(per_sm=nums[4] if len(nums) > 4 else 2)
                if len(nums) > 5:
                    kw.update(min_chunk=nums[5])
                return mla_decode_triton(*args, **kw)

            t = _time(kern)
            nbytes = b * (ctx + 1) * (L + R) * 2 + b * heads * (L + R) * 4 + b * heads * L * 4
            tbs = nbytes / t / 1e6
            tflops = b * heads * (ctx + 1) * (2 * L + R) * 2 / t / 1e6
            ref_bytes = b * window * (L + R) * 6 + 4 * b * heads * window * 4
            if ref_bytes <= REF_MAX_BYTES:
                want = mla_decode_ref(q_lat, q_pe, store, slots, lens, window, scale)
                err = rel_rms_error(want, kern())
                t_ref = _time(lambda: mla_decode_ref(q_lat, q_pe, store, slots, lens, window, scale))
                tail = f" {t_ref:>9.1f} {t_ref / t:>7.1f}x {err:>8.1e}"
                del want
            else:
                tail = f" {'(skip)':>9} {'':>8} {'':>8}"
            row = f"{b:>3} {ctx:>6} {window:>6} {t:>9.1f} {tbs:>6.2f} {100 * tbs / copy_tbs:>5.1f}%"
            row += f" {tflops:>7.0f} {100 * tflops / mm_tflops:>4.0f}%" + tail
            row += "".join(f" {_time(lambda: kern(v)):>14.1f}" for v in variants)
            print(row, flush=True)
            torch.cuda.empty_cache()
    if args.no_absorb:
        return
    absorb_table(copy_tbs, batches, heads=32, o_tiles=o_tiles)  # Kimi Linear's MLA
    absorb_table(copy_tbs, batches, o_tiles=o_tiles)  # K3's


def absorb_table(
    copy_tbs: float, batches: list[int], heads: int = H, dn: int = 128, dv: int = 128,
    o_tiles: list[tuple[int, ...]] | None = None,
) -> None:  # fmt: skip
    """The query absorption and output projection around the attention (K3RUN_MLA_ABSORB_KERNELS): the two
    Triton launches against the torch chain they replace (q.float(), einsum with W_UK, the join with the RoPE
    part; einsum with W_UV, the cast to bf16), us per step's pair, in the form `absorb_dot` picks; then each
    form forced: the loops (one sequence at a time, rows loaded ahead, and not ahead: the form before) and the
    tensor-core forms (`dot`, and with each of `o_tiles` for the output projection), the fp32 FMA forms
    (`fma`, K3RUN_MLA_ABSORB_FMA's); `dot err` covers them all. Ceiling: W_UK + W_UV
    (fp32) once over the copy bandwidth. Back-to-back in a graph both read the same weights, which may stay
    in L2 (2 x 8 MB at 32 heads): the ratio is the comparison, the ceiling a DRAM one."""
    from k3run.kernels.mla import mla_o_absorb_ref, mla_q_absorb_ref
    from k3run.kernels.mla.triton import mla_o_absorb_triton, mla_q_absorb_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    w_uk = torch.randn(heads, dn, L, device="cuda", generator=g) / dn**0.5
    w_uv = torch.randn(heads, dv, L, device="cuda", generator=g) / L**0.5
    nbytes = (w_uk.numel() + w_uv.numel()) * 4
    ceil = nbytes / copy_tbs / 1e6
    print(f"\nabsorb kernels, {heads} heads (d_n {dn}, L {L}, R {R}, d_v {dv}); ceiling {ceil:.1f} us")
    o_tiles = o_tiles or []
    print(
        f"{'B':>3} {'kernels us':>10} {'torch us':>9} {'speed-up':>8} {'of ceiling':>10} {'rel err':>8} "
        f"{'loops us':>8} {'not ahead us':>12} {'dot us':>7} {'fma us':>7} {'dot err':>8}"
        + "".join(f" {'o ' + '/'.join(map(str, t)) + ' us':>14}" for t in o_tiles)
    )
    for b in batches:
        q = (torch.randn(b, heads, dn + R, device="cuda", generator=g) / 4).to(torch.bfloat16)
        o_lat = torch.randn(b, heads, L, device="cuda", generator=g)

        def kernels():
            return mla_q_absorb_triton(q, w_uk), mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16)

        def torch_chain():
            return mla_q_absorb_ref(q, w_uk), mla_o_absorb_ref(o_lat, w_uv, torch.bfloat16)

        def loops(ahead: bool = True):  # one sequence at a time (not ahead: each row loaded after the last)
            q_out = mla_q_absorb_triton(q, w_uk, ahead, dot=False)
            return q_out, mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, ahead, dot=False)

        def dots(tiles=None):
            q_out = mla_q_absorb_triton(q, w_uk, dot=True)
            return q_out, mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, dot=True, tiles=tiles)

        def fmas():
            q_out = mla_q_absorb_triton(q, w_uk, fma=True)
            return q_out, mla_o_absorb_triton(o_lat, w_uv, torch.bfloat16, fma=True)

        t_k, t_t, t_l = _time(kernels), _time(torch_chain), _time(loops)
        t_n, t_d, t_f = _time(lambda: loops(False)), _time(dots), _time(fmas)
        (jk, ok), (jt, ot), (jd, od), (jf, of) = kernels(), torch_chain(), dots(), fmas()
        err = max(rel_rms_error(jt, jk), rel_rms_error(ot.float(), ok.float()))
        err_d = max(rel_rms_error(jt, jd), rel_rms_error(ot.float(), od.float()))
        err_d = max(err_d, rel_rms_error(jt, jf), rel_rms_error(ot.float(), of.float()))
        for t in o_tiles:
            err_d = max(err_d, rel_rms_error(ot.float(), dots(t)[1].float()))
        tiles = "".join(f" {_time(lambda: dots(t)):>14.1f}" for t in o_tiles)
        print(
            f"{b:>3} {t_k:>10.1f} {t_t:>9.1f} {t_t / t_k:>7.2f}x {100 * ceil / t_k:>9.0f}% {err:>8.1e} "
            f"{t_l:>8.1f} {t_n:>12.1f} {t_d:>7.1f} {t_f:>7.1f} {err_d:>8.1e}{tiles}",
            flush=True,
        )


if __name__ == "__main__":
    main()
