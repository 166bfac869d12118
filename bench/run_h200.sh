#!/usr/bin/env bash
# One GPU session: the GPU kernel tests, then the benchmark; logs under $OUT (or ./bench_out).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-900}" python -m pytest -p no:cacheprovider -q tests/kernels/test_nvfp4_gemm.py \
    tests/kernels/test_fp8_act_quant.py tests/kernels/test_fp8_gemm.py 2>&1 | tee "$OUT/tests.txt" | tail -15
python bench/probe_scaled_mm.py > "$OUT/probe_scaled_mm.txt" 2>&1
python bench/bench_linear.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_stdout.txt" | grep -v '^{'
