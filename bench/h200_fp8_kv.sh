#!/bin/bash
# bench/h200_fp8_kv.sh — issue 26 (FP8 KV cache) on the H200. STAGES (default "1 2"):
#   1  build; the FP8 KV tests on the GPU (kernels and fused writers against their references, the
#      engine teacher-forced on the Llama-3-8B shape) beside the attention / layer-op / GEMV / engine
#      regressions, in parallel; then bench/cuda_kernels.py: decode B x context 4,096, GQA 32/8, d128,
#      bf16 cache against FP8 (e4m3, e5m2) in the same process (goal at 64 x 4,096: fp8 >= 1.7x), and
#      A/B runs of the FP8 kernel's settings (PAGEDLLM_DECODE_FP8_* and forced plans).
#   2  bench/throughput_gpu.py on the Llama-3-8B shape (random bf16 weights): 500 requests of 2,048
#      random tokens in / 512 out, bf16 KV then FP8 KV in the same process (goal: >= 1.3x output
#      tok/s), each with its pool's token capacity.
# Results and logs under $OUT.
set -uo pipefail
source bench/h200_lib.sh
export PYTHONPATH=/tmp/site PAGEDLLM_CACHE=$PWD/.cache-pagedllm
for stage in ${STAGES:-1 2}; do
  if [ "$stage" = 1 ]; then
    h200_build "$OUT"
    t0=$(date +%s)
    h200_tests "$OUT/tests" 300 \
      "fp8-kernels|tests/python/test_fp8_kv_cache_kernels.py" \
      "fp8-engine|tests/python/test_fp8_kv_cache_cuda.py -s" \
      "attention|tests/python/test_attention_kernels.py" \
      "layer-ops|tests/python/test_layer_ops_cuda.py tests/python/test_cache_ops.py" \
      "gemv|tests/python/test_gemv.py -k rope" \
      "engine|tests/python/test_gpu_engine.py"
    h200_collect_tests "$OUT/tests" "$OUT/tests-all.log" "$OUT/summary.txt" "$t0"
    grep -h "teacher-forced" "$OUT/tests/fp8-engine.log" | tee -a "$OUT/summary.txt"
    kernels() {  # TAG ENV... -- CASES DTYPES...: one bench/cuda_kernels.py run, summarised
      local tag=$1 t0=$(date +%s); shift
      local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
      local cases=$1; shift
      env "${envs[@]}" timeout 120 python3 bench/cuda_kernels.py --cases "$cases" --kv-cache-dtype "$@" --no-prefill \
        --tag "fp8-kv-$tag" --out "$OUT" > "$OUT/kernels-$tag.log" 2>&1
      echo "kernel bench $tag (${envs[*]}) rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
      grep '^{"batch"' "$OUT/kernels-$tag.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$tag', r['batch'], 'x', r['context'], r['block_ids'], r['kv_cache_dtype'], r['ours_us'], 'us', r['ours_TBps'],
          'TB/s', r['plan'], 'speed_vs_auto', r.get('speed_vs_auto'), 'rel_l2', r['rel_l2_vs_sdpa_fp32'])" |
        tee -a "$OUT/summary.txt"
    }
    kernels default -- 64x4096,64x4096:seq,8x4096,1x4096,256x1024 auto fp8 fp8_e5m2
    # A/B of the FP8 kernel's settings (docs/history/cuda_kernels_notes.md "FP8 KV")
    kernels stages2 PAGEDLLM_DECODE_FP8_STAGES=2 -- 64x4096,256x1024 fp8
    kernels warp-s2 PAGEDLLM_DECODE_MODE=warp -- 64x4096:s2,64x4096:s4 fp8
  fi
  if [ "$stage" = 2 ]; then
    [ -f build.log ] || h200_build "$OUT"
    t0=$(date +%s)
    timeout 300 python3 bench/throughput_gpu.py --shapes llama3-8b --num-prompts 500 --input-len 2048 --output-len 512 \
      --kv-cache-dtype auto fp8 --skip-hf --name throughput-gpu-fp8-kv --out "$OUT" > "$OUT/engine.log" 2>&1
    echo "engine bench rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    python3 -c "
import json, sys, glob
r = json.load(open(sorted(glob.glob(sys.argv[1] + '/*throughput-gpu-fp8-kv.json'))[-1]))['shapes']['llama3-8b']
for k in ('pagedllm', 'pagedllm_kv_fp8'):
    e = r.get(k, {}); print(k, {x: e.get(x) for x in ('output_tok_s', 'kv_tokens', 'num_preemptions', 'batch1_s_per_token', 'seconds', 'error')})
print({k: v for k, v in r.items() if k.startswith('kv_')})" "$OUT" 2>&1 | tee -a "$OUT/summary.txt"
  fi
done
