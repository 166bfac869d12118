"""FP8_PB_WO at decode sizes: the fused quantize + split-K GEMV (kernels/fp8_gemm/gemv.py) against the
block-wise _scaled_mm layer (1x128 quantization launch + cuBLAS + crop / bias) and bare _scaled_mm (x already
quantized), per shape and M, in CUDA graphs over L2-busting weight copies (common.graph_ms).

    PYTHONPATH=src python bench/bench_fp8_gemv.py [--sweep]

Columns: times in us; TB/s = the FP8 weight bytes (+ scales) per second; % of the device copy bandwidth
measured in the same run (the ceiling); speed-ups of the GEMV layer over the _scaled_mm layer and over bare
_scaled_mm. --sweep also times block_n x num_warps x num_stages x split variants at M = 1 and 16 and prints
the best next to the default.
"""

# ruff: noqa: B023 (the lambdas run inside graph_ms, within the loop iteration)

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

from k3run.formats import quantize_fp8_block
from k3run.kernels.fp8_act_quant import quantize_act_1x128
from k3run.kernels.fp8_gemm import fp8_pb_wo_linear, fp8_pb_wo_linear_ref
from k3run.kernels.fp8_gemm.gemv import fp8_gemv, gemv_split
from k3run.knobs import reset_knobs
from k3run.testing import rel_rms_error

sys.path.insert(0, os.path.dirname(__file__))
from common import copies_for, copy_bandwidth, graph_ms  # noqa: E402

# (N, K): 7168^2; MLA fused q_a + kv_a (2112); KDA in_proj per TP8 rank (6284); a K3 q/k/v-sized projection;
# o_proj (K = 96 heads x 128); MLA kv_b_proj (N = 96 x 256, K = 512)
SHAPES = [(7168, 7168), (2112, 7168), (6284, 7168), (12288, 7168), (7168, 12288), (24576, 512)]
MS = [1, 2, 4, 8, 16]


def weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n_pad = -(-n // 128) * 128
    out = []
    for _ in range(copies_for(n_pad * k)):
        q, scale = quantize_fp8_block(torch.randn(n, k, device="cuda"))
        w_pad = torch.zeros(n_pad, k, dtype=torch.float8_e4m3fn, device="cuda")
        w_pad[:n] = q
        out.append((w_pad, scale.reshape(scale.shape[0], scale.shape[2]).contiguous()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in SHAPES:
        wsp = weights(n, k)
        n_pad = wsp[0][0].shape[0]
        nbytes = n_pad * k + n_pad * k / 128**2 * 4
        bias = torch.randn(n, device="cuda").bfloat16()
        os.environ["K3RUN_FP8_GEMV"] = "0"
        reset_knobs()
        for m in MS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, sx = quantize_act_1x128(x, m_multiple=4, scale_outer_major=True)
            ref = fp8_pb_wo_linear_ref(x.float(), wsp[0][0], wsp[0][1], n, bias.float())

            def bare(w, s):
                return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=s.t(), out_dtype=torch.bfloat16)

            t_bare = graph_ms([lambda w=w, s=s: bare(w, s) for w, s in wsp], 0.03) * 1e3
            t_layer = (
                graph_ms([lambda w=w, s=s: fp8_pb_wo_linear(x, w, s, n, bias) for w, s in wsp], 0.03) * 1e3
            )
            t_gemv = graph_ms([lambda w=w, s=s: fp8_gemv(x, w, s, n, bias) for w, s in wsp], 0.03) * 1e3
            t_pre = (
                graph_ms([lambda w=w, s=s: fp8_gemv(x, w, s, n, bias, prequant=True) for w, s in wsp], 0.03)
                * 1e3
            )
            err = rel_rms_error(ref, fp8_gemv(x, wsp[0][0], wsp[0][1], n, bias).float())
            err_sm = rel_rms_error(ref, fp8_pb_wo_linear(x, wsp[0][0], wsp[0][1], n, bias).float())
            best = ""
            if args.sweep and m in (1, 16):
                auto = gemv_split(n_pad, k, 128, sms)
                splits = sorted(
                    {auto, max(1, auto // 2), auto * 2} & {d for d in range(1, 17) if (k // 128) % d == 0}
                )
                trials = {}
                for pre, bn, nw, st, sp in itertools.product(
                    (False, True), (64, 128), (4, 8), (3, 4), splits
                ):
                    kw = dict(block_n=bn, split_k=sp, num_warps=nw, num_stages=st, prequant=pre)
                    fns = [lambda w=w, s=s: fp8_gemv(x, w, s, n, bias, **kw) for w, s in wsp]
                    name = f"{'pre' if pre else 'fused'} bn{bn} w{nw} s{st} sk{sp}"
                    try:
                        trials[name] = graph_ms(fns, 0.03) * 1e3
                    except Exception as e:  # a variant that does not compile / fit
                        trials[f"{name} ({type(e).__name__})"] = float("inf")
                name, t_best = min(trials.items(), key=lambda kv: kv[1])
                best = f" | best {t_best:6.1f} us ({name}) {nbytes / t_best / 1e6:4.2f} TB/s"
            tbs = nbytes / t_gemv / 1e6
            rows.append(
                f"{n:>5}x{k:<5} M={m:<2} | bare {t_bare:6.1f} | layer {t_layer:6.1f} | gemv {t_gemv:6.1f} us "
                f"{tbs:4.2f} TB/s {100 * tbs / copy_tbs:3.0f}% | pre {t_pre:6.1f} "
                f"| x layer {t_layer / t_gemv:4.2f} "
                f"x bare {t_bare / t_gemv:4.2f} | err gemv {err:.1e} sm {err_sm:.1e}{best}"
            )
            print(rows[-1], flush=True)
        os.environ.pop("K3RUN_FP8_GEMV")
        reset_knobs()
        del wsp
        torch.cuda.empty_cache()
    print(
        f"\n{torch.cuda.get_device_name()}, copy {copy_tbs:.2f} TB/s (read + write); times in us, bf16 in/out"
    )
    print("bare = _scaled_mm on quantized x; layer = quantize + _scaled_mm + crop/bias; gemv = fused GEMV")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
