#!/usr/bin/env bash
# One batch on the H200 device machine for the engine (issue 7): build in place (falling back
# to a build without the fused layer kernels if they fail to compile, so the rest still runs),
# the CUDA tests of the kernels and the engine, then bench/throughput_gpu.py. Everything lands
# in $OUT (at most 8 files come back from the device tool).
#   OUT=/some/dir NAME=throughput_gpu-run4 [SHAPES="llama3-8b qwen2-0.5b"] [TESTS="file ..."]
#     [PYTEST_K="not slow"] [BENCH_ARGS=--skip-hf] [TEST_TIMEOUT=s] [BENCH_TIMEOUT=s] bash bench/h200_engine_run.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-throughput_gpu}
SHAPES=${SHAPES:-llama3-8b qwen2-0.5b}
TESTS=${TESTS:-tests/python/test_layer_ops.py tests/python/test_cuda_kernels.py tests/python/test_attention_kernels.py tests/python/test_cache_ops.py tests/python/test_gpu_engine.py}
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -30
  echo "BUILD FAILED: retrying without the fused layer kernels"
  mkdir -p /tmp/layer_ops_cu && mv cuda/rms_norm.cu cuda/activation.cu cuda/rotary_embedding.cu /tmp/layer_ops_cu/
  rm -rf build/cp3*
  CXXFLAGS=-DPAGEDLLM_NO_LAYER_OPS_CUDA python3 -m pip install --no-build-isolation --no-deps -e . \
    >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
: > "$OUT/tests.log"
for f in $TESTS; do  # one process per file: a crash in one file does not hide the others
  echo "== $f" >> "$OUT/tests.log"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest "$f" -m cuda -q -rf -p no:cacheprovider --maxfail=30 \
    ${PYTEST_K:+-k "$PYTEST_K"} >> "$OUT/tests.log" 2>&1
  echo "rc=$?" >> "$OUT/tests.log"
done
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|error|FAILED|rc=" "$OUT/tests.log" | tail -40
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-330}" python3 bench/throughput_gpu.py --shapes $SHAPES --name "$NAME" --out "$OUT" ${BENCH_ARGS:-} \
  > "$OUT/bench.log" 2>&1
echo "bench: $(( $(date +%s) - t0 )) s"
grep -vE "^\s*$" "$OUT/bench.log" | grep -E "output_tok_s|ratio_vs_hf|batch1|fraction|Error|error" | head -40
