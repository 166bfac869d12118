#!/usr/bin/env bash
# GPU session, second call: the new tests (Gluon decode kernel, NCCL), the decode sweep, then the KDA tests.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -p no:cacheprovider -q -rfE -x tests/kernels/test_nvfp4_gemv_gpu.py 2>&1 | tee "$OUT/t_gemv.txt" | tail -25
timeout 120 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_fp8_gemm.py tests/layers/test_linear_tp.py -k "gpu or nccl or torchrun" 2>&1 | tee "$OUT/t_fp8_tp.txt" | tail -30
timeout 260 python3 bench/bench_gemv.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemv_stdout.txt" | grep -v '^{' | tail -22
timeout 200 python3 -m pytest -p no:cacheprovider -q -rfE --durations=0 tests/kernels/test_kda_gpu.py 2>&1 | tee "$OUT/t_kda.txt" | tail -30
