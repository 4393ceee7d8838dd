#!/usr/bin/env bash
# The issue-7 device batch (sessions 10-11), one call (~8 min): build; the CUDA tests of the engine,
# sampler, sampling ops, attention, GEMV (with the paired rope and gate/up rows) and layer ops; then the
# benchmarks twice for an A/B in one call: bench/throughput_gpu.py on both shapes (HF in the first
# run only) and bench/batch1_breakdown.py, first as the code stands, then with B_ENV set (default:
# async scheduling off; e.g. B_ENV=PAGEDLLM_ROPE_PAIRED=0 B_NAME=-unpaired for the paired qkv rows);
# last bench/batch1_graph.py with GRAPH_VARIANTS (default: base and the two other rope forms).
# Everything lands in $OUT/work and comes back as one tarball ($OUT/$NAME.tgz: the device tool
# returns at most 8 files) beside $OUT/summary.log.
#   OUT=/some/dir NAME=s10 PAGEDLLM_COMMIT=<sha> [B_ENV=VAR=VALUE B_NAME=-suffix B_SHAPES="llama3-8b"]
#   [GRAPH_VARIANTS="base ..."] [TESTS="test_gemv ..."] bash bench/h200_async.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s10}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
W=$OUT/work
mkdir -p "$W"
finish() { tar czf "$OUT/$NAME.tgz" -C "$W" . ; }
trap finish EXIT
h200_build "$W" | tee "$OUT/summary.log" || exit 1
t0=$(date +%s)
rm -rf tlog
# TESTS="test_x test_y": only those files (tests/python/NAME.py); default: the list below
TESTS=${TESTS:-test_async_scheduling test_sampler test_sampling_ops test_attention_kernels test_gemv test_layer_ops_cuda test_rope_paired_rows test_gate_up_paired_rows test_gpu_engine}
specs=()
for t in $TESTS; do specs+=("$t|tests/python/$t.py"); done
h200_tests tlog 300 "${specs[@]}"
h200_collect_tests tlog "$W/$NAME-tests.log" "$OUT/summary.log" "$t0"
# the CPU-side async scheduling tests on this host too (not cuda-marked)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_async_scheduling.py -m "not cuda" \
  > "$W/$NAME-cpu-tests.log" 2>&1
echo "cpu async tests: rc=$? $(tail -1 "$W/$NAME-cpu-tests.log")" | tee -a "$OUT/summary.log"
B_ENV=${B_ENV:-}
B_NAME=${B_NAME:--sync}
run_tp() {  # run_tp SUFFIX ENV ARGS...: throughput_gpu, its headline rows to the summary
  local suffix=$1 envs=$2 t0
  shift 2
  t0=$(date +%s)
  env $envs timeout 200 python3 bench/throughput_gpu.py --name "throughput_gpu-$NAME$suffix" --out "$W" "$@" \
    > "$W/$NAME$suffix-throughput.log" 2>&1
  echo "throughput_gpu$suffix: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -E '"output_tok_s"|ratio_vs_hf|batch1_s_per_token|batch1_vs_floor|fraction_of_roofline|"async_scheduling"' \
    "$W/$NAME$suffix-throughput.log" | head -24 | tee -a "$OUT/summary.log"
}
run_b1() {  # run_b1 SUFFIX true|false ENV
  local suffix=$1 t0
  t0=$(date +%s)
  env $3 timeout 120 python3 bench/batch1_breakdown.py --async-scheduling "$2" --out "$W" \
    --name "batch1_breakdown-$NAME$suffix" > "$W/$NAME$suffix-b1.log" 2>&1
  echo "batch1_breakdown$suffix: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -E '"token_us"|"graph_us"|"host_gap_us"|"graph_segments"|"step_us"|"async_scheduling"' \
    "$W/$NAME$suffix-b1.log" | tee -a "$OUT/summary.log"
}
run_tp "" "" --shapes llama3-8b qwen2-0.5b
if [ -n "$B_ENV" ]; then
  # shellcheck disable=SC2086
  run_tp "$B_NAME" "$B_ENV" --shapes ${B_SHAPES:-llama3-8b qwen2-0.5b} --skip-hf
  run_b1 "" true ""
  run_b1 "$B_NAME" true "$B_ENV"
else
  run_tp "$B_NAME" "" --shapes llama3-8b qwen2-0.5b --skip-hf --async-scheduling false
  run_b1 "" true ""
  run_b1 "$B_NAME" false ""
fi
GRAPH_VARIANTS=${GRAPH_VARIANTS-base rope_counters rope_separate}  # empty: no batch1_graph run
if [ -n "$GRAPH_VARIANTS" ]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 200 python3 bench/batch1_graph.py --variants $GRAPH_VARIANTS --tag="-$NAME" --out "$W" \
    > "$W/$NAME-graph.log" 2>&1
  echo "batch1_graph: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -E '"(median_of_passes_us|minus_base_us|x_floor|floor_us)"' "$W/$NAME-graph.log" | head -40 |
    tee -a "$OUT/summary.log"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$OUT/summary.log"
