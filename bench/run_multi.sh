#!/usr/bin/env bash
# Issue 23's runs on one host of several GPUs (device kinds nvidia-h200-x2 / -x4 / -x8), in one script: stages
# run in the order given; logs under $OUT (or ./bench_out). N = the GPUs present (nvidia-smi), or $NGPU.
#   bash bench/run_multi.sh [stage ...]     (default: tptests)
# Stages:
#   tptests  the NCCL tests: tests/engine/test_llm_tp_gpu.py (TP 2, and TP 4 / 8 on the widened tiny Kimi
#            Linear where N allows) and tests/layers/test_linear_tp.py (carry .whl: KDA graphs need fla-core)
#   slice    the K3-shaped 4-layer slice at TP N with 112 local experts a rank (the experts of one EP16 rank
#            times two: 112 x N in all) against one GPU holding 112: decode at batch 1 / 8 / 32 / 64 with uniform
#            routing, --profile 3 (the all-reduce share), and each rank's weights and peak memory
#   kl       the full-depth Kimi Linear 48B-A3B (random NVFP4) at TP N against one GPU, the same measures
#   prefill  one 2048- and one 8192-token prefill of the full-depth Kimi Linear at TP N against one GPU
#            (bench/probe_prefill.py, unprofiled repeats)
#   nodes    `torchrun --nnodes 2` on this host, two "nodes" of N / 2 ranks (separate launchers, static
#            rendezvous): the widened tiny Kimi Linear through `k3run generate`; both launchers must exit 0
#            (the shutdown barrier included) and print what one process prints
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_out}"
mkdir -p "$OUT"
export PYTHONPATH="src:${PYTHONPATH:-}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="src:/tmp/site:${PYTHONPATH#src:}"
fi
N="${NGPU:-$(nvidia-smi -L | wc -l)}"
echo "GPUs: $N"
run_tp() {  # run_tp NPROC LOG ARGS...: bench/probe_graph_step.py under torchrun (plain python for 1)
    local n=$1 log=$2
    shift 2
    if [ "$n" = 1 ]; then
        timeout 600 python3 bench/probe_graph_step.py "$@" 2>&1 | tee "$OUT/$log"
    else
        timeout 600 torchrun --nproc-per-node "$n" bench/probe_graph_step.py "$@" 2>&1 | tee "$OUT/$log"
    fi | grep -E "^graphs|kernels per step|GiB|distinct|^ *[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$"
}
rc=0
for stage in "${@:-tptests}"; do
    echo "== $stage"
    case "$stage" in
    tptests) timeout -s KILL 900 python3 -m pytest -p no:cacheprovider -o addopts="--import-mode=importlib" -v -rfE \
            -m gpu tests/engine/test_llm_tp_gpu.py tests/layers/test_linear_tp.py >"$OUT/tptests.txt" 2>&1
        grep -E "PASS|FAIL|SKIP|passed|failed" "$OUT/tptests.txt" | tail -20 ;;
    slice) run_tp "$N" slice_tp.txt --k3-shaped "4,$((112 * N))" --batch-sizes 1,8,32,64 --steps 24 \
            --uniform-routing --profile 3
        run_tp 1 slice_one.txt --k3-shaped 4,112 --batch-sizes 1,8,32,64 --steps 24 --uniform-routing ;;
    kl) run_tp "$N" kl_tp.txt --kimi-linear --batch-sizes 1,8,32,64 --steps 24 --uniform-routing --profile 3
        run_tp 1 kl_one.txt --kimi-linear --batch-sizes 1,8,32,64 --steps 24 --uniform-routing ;;
    prefill) timeout 600 torchrun --nproc-per-node "$N" bench/probe_prefill.py --model kimi-linear --tokens 2048,8192 \
            --no-profile 2>&1 | tee "$OUT/prefill_tp.txt" | grep -E "unprofiled|graphs"
        timeout 600 python3 bench/probe_prefill.py --model kimi-linear --tokens 2048,8192 --no-profile 2>&1 \
            | tee "$OUT/prefill_one.txt" | grep -E "unprofiled|graphs" ;;
    nodes) timeout -s KILL 600 python3 -m pytest -p no:cacheprovider -o addopts="--import-mode=importlib" -v -rfE \
            tests/models/test_kimi_model.py -k two_torchrun_nodes >"$OUT/nodes.txt" 2>&1
        tail -5 "$OUT/nodes.txt" ;;
    *) echo "unknown stage $stage"; rc=2 ;;
    esac
done
exit $rc
