#!/usr/bin/env bash
# GPU session, third call: the GPU tests not yet run on this image, then the decode-kernel sweep.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -p no:cacheprovider -rfE tests/kernels/test_nvfp4_gemv_gpu.py tests/kernels/test_nvfp4_gemm.py \
    tests/layers/test_linear.py tests/quant/test_nvfp4_fp8_path.py tests/kernels/test_fp8_gemm.py -m gpu 2>&1 \
    | tee "$OUT/t_gpu3.txt" | grep -E "passed|failed|FAILED|Error" | tail -15
timeout 300 python3 bench/bench_gemv.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemv_stdout.txt" | grep -v '^{' | grep -v "^  " | tail -14
