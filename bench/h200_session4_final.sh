#!/usr/bin/env bash
# Session 4's closing device batch on merged main (issues 4 and 7), one call (~6-7 min):
# build; the CUDA test files in parallel processes (the forced-plan children of test_cuda_kernels
# and test_gemv were run by their authors on the same kernel code: runs 7a/7b and gemvfuse-run2),
# test_gpu_engine alone; bench/batch1_breakdown.py; bench/throughput_gpu.py on both shapes with HF;
# bench/cuda_kernels.py --quick.   OUT=/some/dir NAME=s4-final bash bench/h200_session4_final.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s4-final}
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1 || { cp build.log "$OUT/"; grep -E "error" build.log | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s ($PAGEDLLM_COMMIT)" | tee "$OUT/summary.log"
PT="-q -rf -p no:cacheprovider --maxfail=10 -m cuda"
mkdir -p tlog && rm -f tlog/*.log
t0=$(date +%s)
( timeout 200 python3 -m pytest tests/python/test_cuda_kernels.py $PT -k "not forced_plans" > tlog/kernels.log 2>&1; echo "rc=$?" >> tlog/kernels.log ) &
for f in test_attention_kernels test_cache_ops test_layer_ops_cuda test_sampling_ops test_sampler; do
  ( timeout 200 python3 -m pytest tests/python/$f.py $PT > "tlog/$f.log" 2>&1; echo "rc=$?" >> "tlog/$f.log" ) &
done
wait
( timeout 150 python3 -m pytest tests/python/test_gpu_engine.py $PT > tlog/test_gpu_engine.log 2>&1; echo "rc=$?" >> tlog/test_gpu_engine.log )
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/$NAME-tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
for f in tlog/*.log; do echo "== $f: $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"; done | tee -a "$OUT/summary.log"
t0=$(date +%s)
timeout 150 python3 bench/throughput_gpu.py --shapes llama3-8b qwen2-0.5b --name "throughput_gpu-$NAME" --out "$OUT" > "$OUT/$NAME-throughput.log" 2>&1
echo "throughput_gpu: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
grep -E '"output_tok_s"|ratio_vs_hf|batch1_s_per_token|batch1_vs_floor|fraction_of_roofline' "$OUT/$NAME-throughput.log" | head -20 | tee -a "$OUT/summary.log"
t0=$(date +%s)
timeout 100 python3 bench/batch1_breakdown.py --out "$OUT" --name "batch1_breakdown-$NAME" > "$OUT/$NAME-b1.log" 2>&1
echo "batch1_breakdown: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
t0=$(date +%s)
timeout 80 python3 bench/cuda_kernels.py --quick --tag "$NAME" --out "$OUT" > "$OUT/$NAME-kernels.log" 2>&1
echo "cuda_kernels --quick: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
tail -15 "$OUT/$NAME-kernels.log" >> "$OUT/summary.log"
