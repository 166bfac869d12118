#!/usr/bin/env bash
# One GPU session in one script: stages run in the order given; logs and tables under $OUT (or ./bench_out).
#   bash bench/run_h200.sh [stage ...]     (default: tests gemv linear)
# Stages:
#   tests   every GPU-marked test (pytest -m gpu), fla-core included when its wheels travel in .whl/
#   kda     bench/bench_kda.py (fla chunk_kda / fused_recurrent_kda vs the fp32 reference)
#   gemv    bench/bench_gemv.py (the Gluon NVFP4 decode kernel's launch sweep; GEMV_ARGS adds options)
#   linear  bench/bench_linear.py (NVFP4, FP8_PB_WO, NVFP4->FP8; LINEAR_ARGS adds options, e.g. --sweep)
#   probe   bench/probes/scaled_mm.py (which K block-wise torch._scaled_mm gets right)
#   host    bench/probes/host_overhead.py (eager vs CUDA-graph time of small calls: KDA decode, NVFP4 M=1)
#   model   the bundled model through `k3run bench` on CUDA (graphs, then --eager) and bench/probe_graph_step.py
#   engine  bench/probe_graph_step.py on a K3-shaped model (bench/k3_shaped.py: 4 layers, 128 local experts,
#           decode overlap on; run the script itself with --compare-overlap for off vs on)
#           with the replay's kernels by name, and bench/bench_norm.py (fused norms vs torch)
#   attn    bench/bench_mla_decode.py (MLA decode kernel vs the fp32 reference at K3 widths)
#   moe     bench/bench_moe_grouped.py (routed experts: expert-major vs per-pick launches vs the loop)
#   fp8gemv bench/bench_fp8_gemv.py (the FP8_PB_WO decode GEMV vs the _scaled_mm layer; FP8GEMV_ARGS, e.g. --sweep)
#   tile    bench/bench_tile.py (the NVFP4 tile GEMM, grouped experts at prefill sizes, time to first token)
#   prefill bench/probe_prefill.py (one 8192-token prefill of the full-depth Kimi Linear, per module)
#   decode  bench/bench_moe_ops.py, bench/bench_sampling.py, then bench/probe_graph_step.py --kimi-linear at
#           batch 1 / 8 / 32 with
#           kernels/moe_ops on (--profile 3; the first probe on a fresh machine compiles for ~60-90 s), then
#           with K3RUN_MOE_OPS=0 (the same-run baseline)
#   sm90    the CUDA C++ NVFP4 GEMM: bench/probes/sm90_sanity.py under compute-sanitizer (builds it), its tests, then bench/bench_sm90_gemm.py with Marlin
#           from .peers (copy ../shared/peers there and carry it; SM90_ARGS adds options)
#   sm90ncu ncu (full set, one launch each) of the sm90 CUDA GEMM at 7168^2, M = 16 (16,1,2,8) and M = 256
#           (256,1,1,3), or NCU_SPECS='16:16,1,0,8 ...' (M:config): details and per-SASS-line stall samples
#           under $OUT (bench/probes/sm90_ncu.py)
#   gemvncu ncu (full set, per-SASS-line stall samples in ncu_*_sass.csv) of one dense in_proj launch (12448 x
#           2304) at 32 rows in K3RUN_GEMV_T32_FORM 1/1 and 1/2 and at 16 rows (bench/probes/expert_ncu.py), or
#           NCU_SPECS='rows:form ...'
#   expertncu ncu (full set, per-SASS-line stalls) of the routed experts' expert-major launch at 8 tokens: w13
#           with 2 and 4 ring slots and w2 with 2, or NCU_SPECS='which:tokens:slots[:k3] ...'
#           (bench/probes/expert_ncu.py)
#   mlancu  ncu (full set, per-SASS-line stalls in ncu_mla_*_sass.csv) of the MLA decode launch's two kernels (the
#           split programs, the merge) at one sequence of 8K and 32K and 8 sequences of 8K, 32 heads
#           (bench/probes/mla_ncu.py), or NCU_SPECS='batch:ctx:heads ...'
#   gemvtests the NVFP4 decode kernel's and linear paths' GPU tests (tests/kernels/test_nvfp4_gemv_gpu.py,
#           test_nvfp4_gemm.py, test_nvfp4_gemv_compile.py)
#   graphs  tests/engine/test_graph_decode.py, test_prefill_graphs.py, tests/kernels/test_split_k_counters.py,
#           test_pdl_gpu.py, tests/layers/test_moe_combine_in_norm.py and tests/kernels/test_mla_decode.py
#           (GPU-marked; carry .whl), then
#           test_graph_decode.py again with K3RUN_MOE_ROUTER_ONE_LAUNCH=1, the small-step trio off
#           (K3RUN_MOE_COMBINE_IN_NORM=0 K3RUN_MOE_ACT_IN_GEMM1=0 K3RUN_MLA_ABSORB_KERNELS=0) and the
#           fused KDA decode on
#   moetests the MoE's GPU tests (tests/layers/test_moe.py, test_moe_shared_fusion.py, tests/kernels/test_moe_ops.py),
#           the NVFP4 linear's (tests/kernels/test_nvfp4_gemm.py: 17..256 rows on the CUDA C++ GEMM), the
#           sampler kernels' and the KDA layer's (tests/kernels/test_sampling.py, tests/layers/test_kda.py)
#   pending  the GPU tests of the CPU-built decode changes not yet run on a GPU (KDA fused decode, the gathered
#           wgmma x, sampling kernels, KDA's f_b branch, router partials), bench_kda_decode, bench_wgmma gather
#   pendingab the full-depth Kimi Linear decode at batch 1 / 8 / 32, one model, an engine per setting: shipped,
#           then each pending knob alone (gather 64, KDA fused 256, router partials 64, f_b side, MLA absorb
#           32), the small-step trio off, shipped again
#   smallab  the full-depth Kimi Linear at batch 24 / 32 as shipped (17..32 rows on matrices under 32M weights
#           on the decode kernel), then with WGMMA_SMALL_M_MIN_WEIGHTS=0 (the wgmma GEMM from 17 rows, as before)
#   expertgemv bench/bench_expert_gemv.py: each expert-major decode launch alone at Kimi Linear's, then K3's
#           expert shapes, every split_k and token tile, against the hit experts' bytes and a dense matrix
#   streamk the CUDA C++ GEMM's stream-K form: its GPU tests (tests/kernels/test_nvfp4_sm90.py -k stream_k),
#           then bench/bench_sm90_gemm.py at 16 / 32 / 64 / 256 rows with K3RUN_SM90_STREAM_K=256 (the default
#           config stream-K where the fixed grid leaves slots idle; the sweep holds both forms) and Marlin
#           from .peers
#   kdafused KDA's one-launch decode step: its GPU tests (tests/kernels/test_kda_decode_fused.py, the layer's
#           fused tests), bench/bench_kda_decode.py (against the three-launch chain), then the full-depth
#           Kimi Linear decode at batch 1 / 8 / 32 with K3RUN_KDA_FUSED_DECODE 0 / 256, twice, and the profile
#           of the last (fused) engine (carry .whl)
#   decodeab the full-depth Kimi Linear decode at batch 1 / 8 / 16 / 32, one model and an engine per setting
#           (probe_graph_step --configs): as shipped, the small-step trio (K3RUN_MLA_ABSORB_KERNELS,
#           K3RUN_MOE_COMBINE_IN_NORM, K3RUN_MOE_ACT_IN_GEMM1) off, the trio up to 16 tokens, the MLA absorb kernels up to 32, the router's
#           partials up to 64 tokens (K3RUN_MOE_ROUTER_PARTIALS=64), KDA's f_b on the side stream
#           (K3RUN_KDA_FB_SIDE=1), as shipped again; uniform routing (the
#           random model's own routing collapses onto a few experts); the probe's output in decodeab.txt
#   tileab  the full-depth Kimi Linear decode at batch 16 / 32 / 64 (uniform routing) with the expert-major
#           launches' 8-token tile forced (K3RUN_MOE_BY_EXPERT_TILE=8), then with the default (16 above 8 tokens),
#           twice, one model (probe_graph_step --configs)
#   fusedspread the shared expert fused up to 128 tokens (K3RUN_MOE_FUSE_SHARED=128) against apart, batch 32, the
#           model's own routing: the distinct experts each reads (bench/NOTES.md session 33)
#   gatherab the dense wgmma GEMM reading x in place with PDL (K3RUN_WGMMA_X_GATHER): its GPU tests, bench_wgmma
#           at Kimi Linear's projection shapes (17 / 32 / 64 rows: copy + launch vs gathered + PDL, same run),
#           then the full-depth Kimi Linear decode at batch 16 / 32 (uniform routing) off / on / off / on, one
#           model (probe_graph_step --configs)
#   kdatests KDA's GPU tests (tests/kernels/test_kda_conv.py, test_kda_state.py, test_kda_gpu.py; carry .whl)
#   graphtest tests/engine/test_graph_decode.py alone, then again with MLA prefill on its fp32 form
# fla-core (pure Python) travels as wheels: see bench/NOTES.md "KDA on GPU" and the device README.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
# ncu_report TAG KERNEL_REGEX SKIP COUNT GREP_PATTERN COMMAND...: ncu's full set of COUNT launches of the kernels
# matching KERNEL_REGEX after SKIP of them, kept as $OUT/ncu_TAG_details.txt and per-SASS-line samples in
# $OUT/ncu_TAG_sass.csv (the report itself is removed); prints the command's last line and GREP_PATTERN's lines
ncu_report() {
    local tag=$1 regex=$2 skip=$3 count=$4 pattern=$5
    shift 5
    timeout -s KILL "${NCU_TIMEOUT:-100}" ncu --clock-control none -k "regex:$regex" --launch-skip "$skip" \
        --launch-count "$count" --set full --import-source yes -f -o "$OUT/ncu_$tag" "$@" >"$OUT/ncu_${tag}_run.txt" 2>&1
    tail -1 "$OUT/ncu_${tag}_run.txt"
    ncu -i "$OUT/ncu_$tag.ncu-rep" --page details >"$OUT/ncu_${tag}_details.txt" 2>&1
    ncu -i "$OUT/ncu_$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_${tag}_sass.csv" 2>&1
    rm -f "$OUT/ncu_$tag.ncu-rep"
    grep -E "$pattern" "$OUT/ncu_${tag}_details.txt" | head -$((6 * count))
}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests gemv linear)
rc=0
for stage in "${stages[@]}"; do
    echo "== $stage"
    case $stage in
    sm90) timeout -s KILL "${SANITY_TIMEOUT:-300}" compute-sanitizer --tool memcheck python3 bench/probes/sm90_sanity.py 2>&1 \
            | tee "$OUT/sm90_sanity.txt" | tail -8
        timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -o addopts="--import-mode=importlib" -q -rfE tests/kernels/test_nvfp4_sm90.py \
            2>&1 | tee "$OUT/tests_sm90.txt" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -20
        timeout -s KILL "${BENCH_TIMEOUT:-480}" python3 bench/bench_sm90_gemm.py --peers .peers ${SM90_ARGS:-} 2>&1 | tee "$OUT/bench_sm90.txt" \
            | grep -v "^  config" ;;
    tests) timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -p no:cacheprovider -rfE -m gpu tests 2>&1 \
        | tee "$OUT/tests_gpu.txt" | grep -E "passed|failed|FAILED|ERROR" | tail -20 ;;
    kda) timeout 300 python3 bench/bench_kda.py --out "$OUT" 2>&1 | tee "$OUT/bench_kda_stdout.txt" | grep -v '^{' ;;
    gemv) timeout 400 python3 bench/bench_gemv.py --out "$OUT" ${GEMV_ARGS:-} 2>&1 \
        | tee "$OUT/bench_gemv_stdout.txt" | grep -v '^{' | grep -v '^  ' ;;
    linear) timeout 500 python3 bench/bench_linear.py --out "$OUT" ${LINEAR_ARGS:-} 2>&1 \
        | tee "$OUT/bench_linear_stdout.txt" | grep -v '^{' ;;
    probe) python3 bench/probes/scaled_mm.py >"$OUT/probe_scaled_mm.txt" 2>&1; tail -5 "$OUT/probe_scaled_mm.txt" ;;
    host) timeout 200 python3 bench/probes/host_overhead.py 2>&1 | tee "$OUT/probe_host.txt" | tail -8 ;;
    model) for mode in "" --eager; do  # decode from CUDA graphs, then eagerly
            timeout 200 python3 -m k3run.cli bench assets/default-model-k3-mixed --device cuda --dtype bf16 \
                --batch-sizes 1,8 --prompt-len 64 --decode-tokens 64 --no-progress $mode 2>&1 \
                | tee "$OUT/model_bench$mode.txt" | tail -4
        done
        timeout 120 python3 bench/probe_graph_step.py --batch-sizes 1,8 2>&1 | tee "$OUT/graph_step.txt" | tail -4 ;;
    engine) timeout 300 python3 bench/probe_graph_step.py --k3-shaped 4,128 --batch-sizes 1,8 --steps 32 --profile 8 \
            --eager 2>&1 | tee "$OUT/graph_step_k3.txt" | grep -v -i warn | head -60
        timeout 100 python3 bench/bench_norm.py 2>&1 | tee "$OUT/bench_norm.txt" ;;
    attn) timeout 300 python3 bench/bench_mla_decode.py 2>&1 | tee "$OUT/bench_mla_decode.txt" | grep -v -i warn ;;
    moe) timeout 300 python3 bench/bench_moe_grouped.py 2>&1 | tee "$OUT/bench_moe_grouped.txt" | tail -6 ;;
    fp8gemv) timeout 400 python3 bench/bench_fp8_gemv.py ${FP8GEMV_ARGS:-} 2>&1 | tee "$OUT/bench_fp8_gemv.txt" | tail -32 ;;
    tile) timeout 450 python3 bench/bench_tile.py --out "$OUT" ${TILE_ARGS:-} 2>&1 | tee "$OUT/bench_tile.txt" \
        | grep -v '^ ' | tail -40 ;;
    prefill) timeout 300 python3 bench/probe_prefill.py --model kimi-linear --tokens 8192 2>&1 \
        | tee "$OUT/probe_prefill.txt" | grep -v -i warn | tail -16 ;;
    decode) timeout 150 python3 bench/bench_moe_ops.py 2>&1 | tee "$OUT/bench_moe_ops.txt" | tail -44
        timeout 100 python3 bench/bench_sampling.py 2>&1 | tee "$OUT/bench_sampling.txt"
        timeout 320 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 1,8,32 --steps 32 --profile 3 \
            2>&1 | tee "$OUT/decode_kl.txt" | grep -E "^graphs|kernels per step" | head -8
        K3RUN_MOE_OPS=0 timeout 200 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 1,8,32 --steps 32 \
            2>&1 | tee "$OUT/decode_kl_ops_off.txt" | grep -E "^graphs" ;;
    sm90ncu) for spec in ${NCU_SPECS:-16:16,1,2,8 256:256,1,1,3}; do  # M:config (split_k 0: stream-K)
            set -- "${spec%%:*}" "${spec#*:}" "m${spec%%:*}_$(echo "${spec#*:}" | tr , _)"  # files by M and config
            timeout -s KILL "${NCU_TIMEOUT:-100}" ncu --clock-control none -k regex:w4a16_kernel --launch-skip 3 \
                --launch-count 1 --set full -f -o "$OUT/ncu_$3" python3 bench/probes/sm90_ncu.py --m "$1" \
                --config "$2" >"$OUT/ncu_$3_run.txt" 2>&1
            tail -2 "$OUT/ncu_$3_run.txt"
            ncu -i "$OUT/ncu_$3.ncu-rep" --page details >"$OUT/ncu_$3_details.txt" 2>&1
            ncu -i "$OUT/ncu_$3.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_$3_sass.csv" 2>&1
            grep -E "Duration|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Achieved Occupancy|Warp Cycles Per Issued" \
                "$OUT/ncu_$3_details.txt" | head -8
        done ;;
    gemvncu) for spec in ${NCU_SPECS:-32:1/1 32:1/2 16:1/1}; do  # rows:K3RUN_GEMV_T32_FORM (ncu, full set)
            set -- "${spec%%:*}" "${spec#*:}" "t${spec%%:*}_$(echo "${spec#*:}" | tr / _)"
            K3RUN_GEMV_T32_FORM="$2" ncu_report "$3" gemv_async 3 1 \
                "Duration|DRAM Throughput|Issued Warp Per Scheduler|Achieved Occupancy|Warp Cycles Per Issued" \
                python3 bench/probes/expert_ncu.py --which dense --t "$1"
        done ;;
    expertncu) for spec in ${NCU_SPECS:-w13:8:2 w13:8:4 w2:8:2}; do  # which:tokens:slots[:k3] (ncu, full set)
            IFS=: read -r which nt slots k3 <<<"$spec"
            ncu_report "${which}_${nt}_${slots}${k3:+_k3}" gemv_async 3 1 \
                "Duration|DRAM Throughput|Issued Warp Per Scheduler|Achieved Occupancy|Warp Cycles Per Issued" \
                python3 bench/probes/expert_ncu.py --which "$which" --t "$nt" --stages "$slots" ${k3:+--k3}
        done ;;
    mlancu) for spec in ${NCU_SPECS:-1:8192:32 1:32768:32 8:8192:32}; do  # batch:context:heads (ncu, full set)
            IFS=: read -r nb nc nh <<<"$spec"
            ncu_report "mla_${nb}_${nc}_${nh}" _mla_ 6 2 \
                "^  _mla|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued" \
                python3 bench/probes/mla_ncu.py --batch "$nb" --ctx "$nc" --heads "$nh"
        done ;;
    gemvtests) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider \
            -o addopts="--import-mode=importlib" -q -rfE \
            tests/kernels/test_nvfp4_gemv_gpu.py tests/kernels/test_nvfp4_gemm.py tests/kernels/test_nvfp4_gemv_compile.py \
            >"$OUT/gemvtests.txt" 2>&1; grep -E "passed|failed|FAILED|ERROR" "$OUT/gemvtests.txt" | tail -12 ;;
    moetests) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider \
            -o addopts="--import-mode=importlib" -q -rfE -m gpu tests/layers/test_moe.py \
            tests/layers/test_moe_shared_fusion.py tests/kernels/test_moe_ops.py tests/kernels/test_nvfp4_gemm.py \
            tests/kernels/test_sampling.py tests/layers/test_kda.py >"$OUT/moetests.txt" 2>&1; grep -E "passed|failed|FAILED|ERROR" "$OUT/moetests.txt" | tail -12 ;;
    decodeab) trio="K3RUN_MLA_ABSORB_KERNELS K3RUN_MOE_COMBINE_IN_NORM K3RUN_MOE_ACT_IN_GEMM1"
        # shellcheck disable=SC2086  # the knob names, one word each
        cfgs=";$(printf '%s=0 ' $trio);$(printf '%s=16 ' $trio);K3RUN_MLA_ABSORB_KERNELS=32"
        cfgs="$cfgs;K3RUN_MOE_ROUTER_PARTIALS=64;K3RUN_KDA_FB_SIDE=1;"
        timeout 590 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 1,8,16,32 --steps 32 \
            --uniform-routing --configs "$cfgs" 2>&1 | tee "$OUT/decodeab.txt" | grep -E "^--|^graphs|Error" ;;
    tileab) timeout 400 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 16,32,64 --steps 24 \
            --uniform-routing --configs "K3RUN_MOE_BY_EXPERT_TILE=8;" --repeat 2 2>&1 | tee "$OUT/tileab.txt" \
            | grep -E "^--|^graphs|Error" ;;
    fusedspread) for n in 128 0; do
            K3RUN_MOE_FUSE_SHARED=$n timeout 200 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 32 \
                --steps 16 2>&1 | tee "$OUT/spread_$n.txt" | grep -E "^graphs|distinct"
        done ;;
    gatherab) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -rfE -m gpu \
            tests/kernels/test_nvfp4_wgmma.py -k "gather or pdl_chain" >"$OUT/gather_tests.txt" 2>&1
        tail -3 "$OUT/gather_tests.txt"
        timeout 200 python3 bench/bench_wgmma.py --shapes 12448x2304,2304x4096,2048x2304,2304x1024 \
            --ms 17,32,64 --no-sweep 2>&1 | tee "$OUT/wgmma_gather.txt" | grep -E "^ *[0-9]+x"
        timeout 300 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 16,32 --steps 24 --uniform-routing \
            --configs "K3RUN_WGMMA_X_GATHER=0;K3RUN_WGMMA_X_GATHER=64" --repeat 2 2>&1 | tee "$OUT/gatherab.txt" \
            | grep -E "^--|^graphs|Error" ;;
    pending) timeout -s KILL "${TEST_TIMEOUT:-330}" python3 -m pytest -p no:cacheprovider \
            -o addopts="--import-mode=importlib" -q -rfE -m gpu tests/kernels/test_kda_decode_fused.py \
            tests/layers/test_kda.py tests/kernels/test_sampling.py tests/kernels/test_nvfp4_wgmma.py \
            tests/kernels/test_moe_ops.py -k "fused or gather or pdl_chain or sampling or side or partials" \
            >"$OUT/pending_tests.txt" 2>&1; grep -E "passed|failed|FAILED|ERROR" "$OUT/pending_tests.txt" | tail -12
        timeout 120 python3 bench/bench_kda_decode.py 2>&1 | tee "$OUT/bench_kda_decode.txt"
        timeout 120 python3 bench/bench_wgmma.py --shapes 12448x2304,2304x4096,2048x2304 --ms 17,32,64 --no-sweep \
            2>&1 | tee "$OUT/wgmma_gather.txt" | grep -E "^ *[0-9]+x|^ *M|gather" ;;
    pendingab) cfgs=";K3RUN_WGMMA_X_GATHER=64;K3RUN_KDA_FUSED_DECODE=256;K3RUN_MOE_ROUTER_PARTIALS=64"
        cfgs="$cfgs;K3RUN_KDA_FB_SIDE=1;K3RUN_MLA_ABSORB_KERNELS=32;K3RUN_MOE_COMBINE_IN_NORM=0 K3RUN_MOE_ACT_IN_GEMM1=0"
        cfgs="$cfgs K3RUN_MLA_ABSORB_KERNELS=0;"
        timeout 590 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 1,8,32 --steps 32 \
            --uniform-routing --configs "$cfgs" 2>&1 | tee "$OUT/pendingab.txt" | grep -E "^--|^graphs|Error" ;;
    smallab) for patch in "" "k3run.kernels.nvfp4_gemm.config:WGMMA_SMALL_M_MIN_WEIGHTS=0"; do
            echo "-- ${patch:-as shipped}"
            timeout 250 python3 ${patch:+bench/probes/patched_constant.py $patch} bench/probe_graph_step.py --kimi-linear \
                --batch-sizes 24,32 --steps 32 --uniform-routing 2>&1 | tee -a "$OUT/smallab.txt" | grep -E "^graphs|Error"
        done ;;
    expertgemv) timeout 200 python3 bench/bench_expert_gemv.py 2>&1 | tee "$OUT/expert_gemv.txt" | grep "^T="
        timeout 200 python3 bench/bench_expert_gemv.py --k3 2>&1 | tee "$OUT/expert_gemv_k3.txt" | grep "^T=" ;;
    streamk) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider \
            -o addopts="--import-mode=importlib" -q -rfE -m gpu tests/kernels/test_nvfp4_sm90.py -k "stream_k" \
            >"$OUT/streamk_tests.txt" 2>&1; tail -3 "$OUT/streamk_tests.txt"
        K3RUN_SM90_STREAM_K=256 timeout 500 python3 bench/bench_sm90_gemm.py --ms 16,32,64,256 --peers .peers \
            2>&1 | tee "$OUT/streamk_bench.txt" | grep -v -i warn | tail -30 ;;
    kdafused) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider \
            -o addopts="--import-mode=importlib" -q -rfE -m gpu tests/kernels/test_kda_decode_fused.py \
            tests/layers/test_kda.py -k "fused" >"$OUT/kdafused_tests.txt" 2>&1; tail -3 "$OUT/kdafused_tests.txt"
        timeout 200 python3 bench/bench_kda_decode.py 2>&1 | tee "$OUT/bench_kda_decode.txt"
        timeout 400 python3 bench/probe_graph_step.py --kimi-linear --batch-sizes 1,8,32 --steps 32 --uniform-routing \
            --configs "K3RUN_KDA_FUSED_DECODE=0;K3RUN_KDA_FUSED_DECODE=256" --repeat 2 --profile 3 2>&1 \
            | tee "$OUT/kdafusedab.txt" | grep -E "^--|^graphs|Error|^profile|decode_fused|recurrent|_conv_dec" ;;
    kdatests) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -o addopts="--import-mode=importlib" \
            -q -rfE -m gpu tests/kernels/test_kda_conv.py tests/kernels/test_kda_state.py tests/kernels/test_kda_gpu.py \
            >"$OUT/kdatests.txt" 2>&1; tail -15 "$OUT/kdatests.txt" ;;
    graphs) timeout -s KILL "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -v -rfE -m gpu \
            tests/engine/test_graph_decode.py tests/engine/test_prefill_graphs.py \
            tests/kernels/test_split_k_counters.py tests/kernels/test_pdl_gpu.py tests/layers/test_moe_combine_in_norm.py \
            tests/kernels/test_mla_decode.py >"$OUT/graphs.txt" 2>&1
        grep -E "PASS|FAIL|SKIP|Error|assert|passed|failed" "$OUT/graphs.txt" | tail -30
        K3RUN_MOE_ROUTER_ONE_LAUNCH=1 K3RUN_MOE_COMBINE_IN_NORM=0 K3RUN_MOE_ACT_IN_GEMM1=0 \
            K3RUN_MLA_ABSORB_KERNELS=0 K3RUN_KDA_FUSED_DECODE=16 timeout -s KILL "${TEST_TIMEOUT:-300}" \
            python3 -m pytest \
            -p no:cacheprovider -q -rfE -m gpu tests/engine/test_graph_decode.py >"$OUT/graphs_pdl.txt" 2>&1
        tail -3 "$OUT/graphs_pdl.txt" ;;
    graphtest) timeout 250 python3 -m pytest -p no:cacheprovider -v -rfE -m gpu tests/engine/test_graph_decode.py \
            >"$OUT/graphtest.txt" 2>&1; grep -E "PASS|FAIL|Error|assert" "$OUT/graphtest.txt" | head -20
        timeout 250 python3 -c "import sys, pytest; from k3run.layers.mla import KimiMLA; \
KimiMLA._attend_flash = KimiMLA._attend_expanded_fp32; \
sys.exit(pytest.main(['-p', 'no:cacheprovider', '-v', '-rfE', '-m', 'gpu', 'tests/engine/test_graph_decode.py']))" \
            >"$OUT/graphtest_fp32_mla.txt" 2>&1; grep -E "PASS|FAIL|Error|assert" "$OUT/graphtest_fp32_mla.txt" | head -20 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
    esac
    [ $? -ne 0 ] && rc=1
done
exit $rc
