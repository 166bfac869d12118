#!/usr/bin/env bash
# One GPU session's verification pass: every test on CUDA (GPU-marked first), then the KDA benchmark.
# fla-core travels as wheels in .whl (bench/NOTES.md "KDA on GPU"); logs under $OUT (or ./bench_out).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), torch.cuda.get_device_name())' | tee "$OUT/env.txt"
timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -m gpu -rs tests 2>&1 | tee "$OUT/tests_gpu.txt" | tail -25
timeout "${ALL_TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider -q -m "not gpu" -x tests 2>&1 | tee "$OUT/tests_all.txt" | tail -8
timeout "${KDA_TIMEOUT:-180}" python3 bench/bench_kda.py --out "$OUT" 2>&1 | tee "$OUT/bench_kda.txt" | grep -v '^{'
