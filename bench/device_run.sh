#!/usr/bin/env bash
# bench/device_run.sh — one call of the lent GPU machine (the `run` tool: 10 minutes a call): build
# this tree in place, then run a list of steps; logs and JSON under $OUT, one line per step (and the
# tests' result lines) in $OUT/summary.log. Replaces the one-off bench/h200_run*.sh family.
#
#   OUT=/some/dir bash bench/device_run.sh STEP [STEP...]      (the run tool sets OUT)
#
# Steps (ARGS: shell words, one quoted argument per step):
#   tests:FILE[+FILE...]   those test files' cuda tests, each file its own pytest process, in parallel
#   kernel-tests           test_cuda_kernels.py's default tests and each forced-plan child, in parallel
#   engine-tests           test_gpu_engine.py alone (it sizes its KV pool from the free memory)
#   throughput[:ARGS]      bench/throughput_gpu.py ARGS (default --shapes llama3-8b)
#   kernels[:ARGS]         pagedllm bench kernels --device cuda ARGS (default: paged_decode and rms_norm,
#                          batch 1 16 64, context 512 4096, GQA 32/8 d128, bf16, against SDPA), JSON + PNG
#   latency[:ARGS]         pagedllm bench latency ARGS (without --model: the Llama-3-8B shape with random
#                          weights; default batch 8, 128 in / 128 out)
#   cuda-kernels[:ARGS]    bench/cuda_kernels.py ARGS (default --quick)
#   batch1                 bench/batch1_breakdown.py
#   grid                   bench/decode_variants.py --variants base
# STEP_TIMEOUT (seconds, default 240; test steps 300) bounds each step.
# Example: OUT=... bash bench/device_run.sh tests:test_beam_search.py+test_spec_decode.py engine-tests throughput
set -uo pipefail
OUT=${OUT:?set OUT}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SUMMARY="$OUT/summary.log"
h200_build "$OUT" | tee "$SUMMARY" || exit 1
limit=${STEP_TIMEOUT:-240}

# step NAME CMD...: CMD under timeout, output to $OUT/NAME.log, its status and seconds to the summary
step() {
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
}

n=0
for spec in "$@"; do
  n=$((n + 1))
  name=${spec%%:*}
  args=""
  [[ "$spec" == *:* ]] && args=${spec#*:}
  case "$name" in
    tests)
      specs=()
      IFS=+ read -ra files <<< "$args"
      for f in "${files[@]}"; do specs+=("${f%.py}|tests/python/$f"); done
      t0=$(date +%s)
      h200_tests "$OUT/tests-$n" "${STEP_TIMEOUT:-300}" "${specs[@]}"
      h200_collect_tests "$OUT/tests-$n" "$OUT/tests-$n.log" "$SUMMARY" "$t0" ;;
    kernel-tests)
      t0=$(date +%s)
      h200_kernel_specs
      h200_tests "$OUT/kernel-tests" "${STEP_TIMEOUT:-300}" "${H200_SPECS[@]}"
      h200_collect_tests "$OUT/kernel-tests" "$OUT/kernel-tests.log" "$SUMMARY" "$t0" ;;
    engine-tests)
      t0=$(date +%s)
      h200_tests "$OUT/engine-tests" "${STEP_TIMEOUT:-300}" "test_gpu_engine|tests/python/test_gpu_engine.py"
      h200_collect_tests "$OUT/engine-tests" "$OUT/engine-tests.log" "$SUMMARY" "$t0" ;;
    throughput)
      eval "step throughput-$n python3 bench/throughput_gpu.py ${args:---shapes llama3-8b} --out \"$OUT\""
      grep -E '"output_tok_s"|batch1_s_per_token|batch1_vs_floor' "$OUT/throughput-$n.log" | head -12 | tee -a "$SUMMARY" ;;
    kernels)
      plot=""
      python3 -c "import matplotlib" 2> /dev/null && plot="--plot \"$OUT/kernels-$n.png\""
      eval "step kernels-$n python3 -m pagedllm bench kernels --device cuda ${args:---op paged_decode rms_norm --batch 1 16 64 --context 512 4096} --json \"$OUT/kernels-$n.json\" $plot"
      grep -E '^(paged_decode|rms_norm|silu_and_mul|reshape_and_cache)' "$OUT/kernels-$n.log" | head -40 | tee -a "$SUMMARY" ;;
    latency)
      # a config-only Llama-3-8B folder (random weights, synthetic tokenizer) unless ARGS name a --model
      shape=/tmp/device-run-llama3-8b
      mkdir -p $shape
      python3 -c "import json, sys; sys.path.insert(0, 'bench'); from throughput_gpu import SHAPES; open('$shape/config.json', 'w').write(json.dumps(SHAPES['llama3-8b']))"
      [[ "$args" == *--model* ]] || args="--model $shape --load-format dummy ${args:---batch-size 8 --input-len 128 --output-len 128}"
      eval "step latency-$n python3 -m pagedllm bench latency $args --no-progress --json \"$OUT/latency-$n.json\""
      grep -E '"median_(prefill_s|decode_ms_per_token)"|"avg_latency_s"' "$OUT/latency-$n.log" | tee -a "$SUMMARY" ;;
    cuda-kernels)
      eval "step cuda-kernels-$n python3 bench/cuda_kernels.py ${args:---quick} --out \"$OUT\""
      grep -h '"batch"' "$OUT/cuda-kernels-$n.log" | cut -c1-260 | head -20 | tee -a "$SUMMARY" ;;
    batch1)
      step batch1-$n python3 bench/batch1_breakdown.py --out "$OUT" ;;
    grid)
      step grid-$n python3 bench/decode_variants.py --out "$OUT" --timeout $((limit - 5)) --variants base ;;
    *)
      echo "unknown step '$name' (see the header of bench/device_run.sh)" | tee -a "$SUMMARY"; exit 2 ;;
  esac
done
