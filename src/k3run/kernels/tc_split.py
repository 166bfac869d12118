"""fp32 products on the bf16 tensor cores without losing a bit (Triton helpers).

An fp32 value w is the exact sum of three bf16 parts (`split3`: hi holds w's top 8 significant bits, the
residual w - hi, exact in fp32, at most 16 more; mid its top 8 and lo the rest). The product of two bf16
values is exact in fp32, so a dot of bf16 parts with fp32 accumulation sums exact products: `dot_split`
(a bf16 operand against a split fp32 one: three dots) and `dot_split2` (two split fp32 operands: nine dots)
give the fp32 sum of the exact products of the original operands, only in another order than a SIMT loop's,
and the tensor core's accumulation (which may truncate: 2 u an addition) is the only rounding. A one-hot
operand therefore returns the other's values bit for bit: the test that a lost or rounded part fails.

The interpreter's bf16 dot is wrong, so there (TC False) the same parts, widened back to fp32, go through
fp32 `ieee` dots: the same split, checked on the CPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# bf16 dots on the tensor cores on the GPU; fp32 dots of the same parts in the interpreter
TENSOR_CORES = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def split3(w):
    # w fp32 = hi + mid + lo exactly, each a bf16 (bf16 has fp32's exponent range, so nothing underflows at
    # the magnitudes of a weight or an attention output). Holds for round-to-nearest and truncating casts
    # alike (the interpreter truncates)
    hi = w.to(tl.bfloat16)
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _dot(a, b, acc, TC: tl.constexpr):
    if TC:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def dot_split(a, b_hi, b_mid, b_lo, acc, TC: tl.constexpr):
    # acc + a . (b_lo + b_mid + b_hi) for a bf16 [M, K] and the split parts [K, N]; smallest part first
    acc = _dot(a, b_lo, acc, TC)
    acc = _dot(a, b_mid, acc, TC)
    return _dot(a, b_hi, acc, TC)


@triton.jit
def dot_split2(a, b_hi, b_mid, b_lo, acc, TC: tl.constexpr):
    # acc + a . b for an fp32 a [M, K] (split here) and b's split parts [K, N]: all nine part products, the
    # smaller parts of a first
    a_hi, a_mid, a_lo = split3(a)
    acc = dot_split(a_lo, b_hi, b_mid, b_lo, acc, TC)
    acc = dot_split(a_mid, b_hi, b_mid, b_lo, acc, TC)
    return dot_split(a_hi, b_hi, b_mid, b_lo, acc, TC)
