#!/usr/bin/env bash
# One batch on the H200 device machine for the GEMV work (issue 7, batch 1): build in place, the
# CUDA tests of the GEMV, the layer ops and the engine, bench/gemv.py, then bench/throughput_gpu.py
# on the Llama-3-8B shape without HF. Logs and JSON land in $OUT (at most 8 files come back).
#   OUT=/some/dir NAME=gemv-run1 [GEMV_ARGS=--sweep] [TESTS="file ..."] [SKIP_ENGINE=1] bash bench/h200_gemv_run.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-gemv}
TESTS=${TESTS:-tests/python/test_gemv.py tests/python/test_layer_ops_cuda.py tests/python/test_gpu_engine.py tests/python/test_attention_kernels.py}
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || {
  grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
: > "$OUT/tests.log"
for f in $TESTS; do
  echo "== $f" >> "$OUT/tests.log"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest "$f" -m cuda -q -rf -p no:cacheprovider --maxfail=20 >> "$OUT/tests.log" 2>&1
  echo "rc=$?" >> "$OUT/tests.log"
done
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|error|FAILED|rc=" "$OUT/tests.log" | head -40
t0=$(date +%s)
timeout "${GEMV_TIMEOUT:-180}" python3 bench/gemv.py ${GEMV_ARGS:-} --name "$NAME" --out "$OUT" > "$OUT/gemv.log" 2>&1
echo "gemv bench: rc=$? $(( $(date +%s) - t0 )) s"
grep -E "chain|silu_down|Error|error" "$OUT/gemv.log" | head -20
if [ -z "${SKIP_ENGINE:-}" ]; then
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/throughput_gpu.py --shapes llama3-8b --skip-hf --name "$NAME-throughput_gpu" \
    --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "engine bench: rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "output_tok_s|batch1|fraction|Error|error" "$OUT/bench.log" | head -20
fi
