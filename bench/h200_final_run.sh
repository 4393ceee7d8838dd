#!/usr/bin/env bash
# One device batch on merged main (issue 7/4): build, the CUDA kernel tests in parallel processes,
# the GPU engine tests alone, then bench/throughput_gpu.py on both shapes with HF. OUT must be set.
set -uo pipefail
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
: > "$OUT/tests.log"
for f in tests/python/test_gemv.py tests/python/test_layer_ops_cuda.py tests/python/test_cuda_kernels.py tests/python/test_attention_kernels.py tests/python/test_cache_ops.py; do
  echo "== $f" >> "$OUT/tests.log"
  timeout 200 python3 -m pytest "$f" -m cuda -q -rf -p no:cacheprovider --maxfail=20 >> "$OUT/tests.log" 2>&1 &
  pids="${pids:-} $!"
  sleep 1
done
wait
echo '== tests/python/test_gpu_engine.py' >> "$OUT/tests.log"
timeout 200 python3 -m pytest tests/python/test_gpu_engine.py -m cuda -q -rf -p no:cacheprovider >> "$OUT/tests.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|FAILED" "$OUT/tests.log" | head -40
t0=$(date +%s)
timeout 330 python3 bench/throughput_gpu.py --shapes llama3-8b qwen2-0.5b --name throughput_gpu-run6 --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench: rc=$? $(( $(date +%s) - t0 )) s"
grep -E "output_tok_s|ratio_vs_hf|batch1|fraction|Error|error" "$OUT/bench.log" | head -30
