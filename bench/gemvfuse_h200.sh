#!/usr/bin/env bash
# One device batch for the GEMV fusions (helper gemvfuse, issue 7): build; the CUDA tests of the
# GEMV, the layer ops and the GPU engine in parallel processes; bench/gemv.py --chain-only (fused
# op pairs, SiLU-down, layer chains at M = 1 and 8); then the engine's batch-1 decode
# (bench/throughput_gpu.py, Llama-3-8B shape, small workload, no HF) at PAGEDLLM_GEMV_FUSE levels
# given as arguments (default 0 1 2), one process each. OUT must be set; at most 8 files land there.
set -uo pipefail
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
levels=${*:-0 1 2}
log="$OUT/run.log"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log > "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$log"
t0=$(date +%s)
mkdir -p /tmp/t
run_tests() {  # name, pytest args...
  local name=$1; shift
  timeout 240 python3 -m pytest "$@" -m cuda -q -rf -p no:cacheprovider --maxfail=20 > "/tmp/t/$name.log" 2>&1
}
G=tests/python/test_gemv.py
run_tests gemv_cfg $G -k "test_gemv_every_config" &
run_tests gemv_old $G -k "matches_float64 or strided_and_misaligned or test_silu_and_mul_gemv or graph_capture_chain or l2_prefetch or test_gemv_argument_errors or refuses" &
run_tests gemv_norm $G -k "rms_norm_prologue" &
run_tests gemv_res $G -k "residual_epilogue" &
run_tests gemv_fused $G -k "fused_gemv_every_config or fused_layer_chain or model_gemv_fusion or fused_gemv_argument" &
run_tests layer_ops tests/python/test_layer_ops_cuda.py &
run_tests gpu_engine tests/python/test_gpu_engine.py &
wait
for f in /tmp/t/*.log; do echo "== $f"; cat "$f"; done > "$OUT/tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$log"
grep -E "^== |passed|failed|FAILED|error" "$OUT/tests.log" | head -60 >> "$log"
t0=$(date +%s)
timeout 200 python3 bench/gemv.py --chain-only --name gemvfuse-gemv --out "$OUT" >> "$log" 2>&1
echo "gemv bench: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$log"
mkdir -p /tmp/eng
for level in $levels; do
  t0=$(date +%s)
  PAGEDLLM_GEMV_FUSE=$level timeout 120 python3 bench/throughput_gpu.py --shapes llama3-8b --skip-hf \
    --num-prompts 32 --max-num-seqs 32 --output-len 128 --name "gemvfuse-engine-fuse$level" --out /tmp/eng \
    > "/tmp/eng/fuse$level.log" 2>&1
  echo "engine fuse$level: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$log"
  grep -E "batch1_s_per_token|batch1_vs_floor|output_tok_s|Error|error" "/tmp/eng/fuse$level.log" | head -8 >> "$log"
  cp /tmp/eng/*-gemvfuse-engine-fuse$level.json "$OUT/" 2>/dev/null
done
tar czf "$OUT/engine-logs.tgz" -C /tmp/eng . 2>/dev/null
