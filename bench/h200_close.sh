#!/usr/bin/env bash
# A session's closing device batch on merged main (issues 4 and 7), one call (~8 min): build; every
# CUDA test file in parallel processes (the kernel file's forced-plan children included), then
# test_gpu_engine alone; bench/throughput_gpu.py on both shapes with HF; bench/batch1_breakdown.py;
# bench/cuda_kernels.py --quick; the decode grid (bench/decode_variants.py, variant "base").
# Replaces bench/h200_session4_final.sh (session 4's, the same steps without the grid).
#   OUT=/some/dir NAME=s5-final PAGEDLLM_COMMIT=<sha> [SKIP_TESTS="test_gemv"] [AB_ENV="X=0"] [SKIP_GRID=1] bash bench/h200_close.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-final}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
h200_build "$OUT" | tee "$OUT/summary.log" || exit 1  # pipefail: a failed build stops here
t0=$(date +%s)
rm -rf tlog
h200_kernel_specs
specs=("${H200_SPECS[@]}")
# SKIP_TESTS: test files (names, space-separated) verified on an earlier call of the same code
for f in test_attention_kernels test_cache_ops test_layer_ops_cuda test_sampling_ops test_sampler test_gemv; do
  [[ " ${SKIP_TESTS:-} " == *" $f "* ]] && { echo "$f: skipped (SKIP_TESTS)" | tee -a "$OUT/summary.log"; continue; }
  specs+=("$f|tests/python/$f.py")
done
h200_tests tlog 240 "${specs[@]}"
h200_tests tlog 150 "test_gpu_engine|tests/python/test_gpu_engine.py"
h200_collect_tests tlog "$OUT/$NAME-tests.log" "$OUT/summary.log" "$t0"
t0=$(date +%s)
timeout 150 python3 bench/throughput_gpu.py --shapes llama3-8b qwen2-0.5b --name "throughput_gpu-$NAME" --out "$OUT" > "$OUT/$NAME-throughput.log" 2>&1
echo "throughput_gpu: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
grep -E '"output_tok_s"|ratio_vs_hf|batch1_s_per_token|batch1_vs_floor|fraction_of_roofline' "$OUT/$NAME-throughput.log" | head -20 | tee -a "$OUT/summary.log"
t0=$(date +%s)
timeout 90 python3 bench/batch1_breakdown.py --out "$OUT" --name "batch1_breakdown-$NAME" > "$OUT/$NAME-b1.log" 2>&1
echo "batch1_breakdown: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
# quick_kernels SUFFIX [VAR=VALUE...]: bench/cuda_kernels.py --quick under those settings, its
# timing and goal-case rows appended to the summary
quick_kernels() {
  local suffix=$1 t0 rc
  shift
  t0=$(date +%s)
  env "$@" timeout 80 python3 bench/cuda_kernels.py --quick --tag "$NAME$suffix" --out "$OUT" > "$OUT/$NAME-kernels$suffix.log" 2>&1
  rc=$?
  echo "cuda_kernels --quick${*:+ under $*}: rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -h '"batch"' "$OUT/$NAME-kernels$suffix.log" | cut -c1-260 | tee -a "$OUT/summary.log"
}
quick_kernels ""
# AB_ENV: the same quick bench again under these settings (e.g. a switch that turns a change off),
# then once more as before (the run-to-run spread)
if [ -n "${AB_ENV:-}" ]; then
  read -ra ab <<< "$AB_ENV"
  quick_kernels -ab "${ab[@]}"
  quick_kernels -again
fi
[ -n "${SKIP_GRID:-}" ] && exit 0
timeout 90 python3 bench/decode_variants.py --out "$OUT" --name "cuda-kernels-$NAME-grid" --timeout 85 --variants base > "$OUT/$NAME-grid.log" 2>&1
sed -n '/^variant /,$p' "$OUT/$NAME-grid.log" | tee -a "$OUT/summary.log"
