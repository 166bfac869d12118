#!/usr/bin/env bash
# GPU session, last call: NVFP4 tests with the new default dispatch, the NVFP4 linear bench, the bundled model on CUDA.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -p no:cacheprovider -rfE -m gpu tests/kernels/test_nvfp4_gemm.py tests/kernels/test_nvfp4_gemv_gpu.py \
    tests/quant/test_nvfp4_fp8_path.py 2>&1 | tee "$OUT/t_gpu4.txt" | grep -E "passed|failed|FAILED|Error" | tail -12
timeout 120 python3 -m k3run.cli bench assets/default-model-k3-mixed --device cuda --dtype bf16 --batch-sizes 1,8 \
    --prompt-len 64 --decode-tokens 64 --no-progress 2>&1 | tee "$OUT/model_bench.txt" | tail -8
timeout 240 python3 bench/bench_linear.py --skip fp8,nvfp4_fp8 --out "$OUT" 2>&1 | tee "$OUT/bench_linear_stdout.txt" | grep -v '^{' | tail -30
