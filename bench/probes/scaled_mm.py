"""Question: which block-wise torch._scaled_mm calls are exact on this GPU (issue 6 section 3: verify the
layout)?

For each (N, K, M) it quantizes a random weight to 128x128 FP8 blocks (zero-padded to N_pad rows) and x to
1x128 groups, runs _scaled_mm with the weight scales transposed and the activation scales outer-dim-major,
reading N_pad rows or only ceil16(N) rows, with and without a bias, and prints the relative RMS error
against the fp32 product of the dequantized operands (bf16 output: ~2e-3 expected).

    PYTHONPATH=src python bench/probes/scaled_mm.py

Answer (H200, torch 2.11+cu130, bench/RESULTS.md run 3): exact for K = 7168 (56 scale columns), garbage for
K = 640 and 768 (5 and 6 scale columns) with or without padding or bias; `kernels.fp8_gemm.scaled_mm_shape_ok`
trusts only K / 128 divisible by 4 and sends other K to the Triton GEMM.
"""

from __future__ import annotations

import torch

from k3run.formats import dequantize_fp8_act_1x128, dequantize_fp8_block, quantize_fp8_block
from k3run.kernels.fp8_act_quant import quantize_act_1x128
from k3run.testing import rel_rms_error


def main() -> None:
    torch.manual_seed(0)
    print(f"{'N':>5} {'K':>5} {'M':>3} {'rows':>5} {'bias':>5}  rel err")
    for n, k in ((300, 640), (320, 640), (384, 640), (300, 768), (384, 768), (300, 7168), (2112, 640)):
        n_pad, n16 = -(-n // 128) * 128, -(-n // 16) * 16
        q, scale = quantize_fp8_block(torch.randn(n, k, device="cuda"))
        w = torch.zeros(n_pad, k, dtype=torch.float8_e4m3fn, device="cuda")
        w[:n] = q
        s2d = scale.reshape(scale.shape[0], scale.shape[2]).contiguous()
        w32 = dequantize_fp8_block(w, s2d)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, sx = quantize_act_1x128(x, m_multiple=4, scale_outer_major=True)
            ref = dequantize_fp8_act_1x128(xq, sx.contiguous()) @ w32.t()
            for rows in sorted({n16, n_pad}):
                for with_bias in (False, True):
                    bias = torch.randn(rows, device="cuda").bfloat16() if with_bias else None
                    try:
                        out = torch._scaled_mm(
                            xq, w[:rows].t(), scale_a=sx, scale_b=s2d.t(), bias=bias, out_dtype=torch.bfloat16
                        )
                        exp = ref[:, :rows] + (bias.float() if with_bias else 0.0)
                        msg = f"{rel_rms_error(exp, out.float()):.1e}"
                    except RuntimeError as e:
                        msg = f"refused: {str(e)[:90]}"
                    print(f"{n:>5} {k:>5} {m:>3} {rows:>5} {with_bias!s:>5}  {msg}", flush=True)


if __name__ == "__main__":
    main()
