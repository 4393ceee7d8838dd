#!/usr/bin/env bash
# Run 7 (kern4), one device call per phase (bench/cuda_kernels_notes.md "Run 7"): build this tree in
# place; the CUDA tests (the kernel file's default tests and each forced-plan child in parallel
# processes, the attention, cache, layer-op, GEMV and GPU-engine files); then
#   PHASE=a: the split-K combine variants side by side (bench/decode_variants.py: reduction kernel
#            against the in-kernel last-arriver combine, alternating) and the engine-shaped batch-1
#            layer (bench/decode_layer.py) under each;
#   PHASE=b: bench/cuda_kernels.py's full grid with the merged defaults (SDPA in the same process)
#            and bench/decode_layer.py.
# Files back (at most 8): gpu.txt, build.log (on failure), tests.log, bench.log, the JSON(s).
#   OUT=/some/dir PHASE=a bash bench/h200_run7.sh
set -uo pipefail
OUT=${OUT:?set OUT}
PHASE=${PHASE:-a}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
h200_build "$OUT" | tee "$OUT/bench.log" || exit 1  # pipefail: a failed build stops here
t0=$(date +%s)
rm -rf tlog
h200_kernel_specs
specs=("${H200_SPECS[@]}")
for f in test_attention_kernels test_cache_ops test_layer_ops_cuda test_gemv; do specs+=("$f|tests/python/$f.py"); done
h200_tests tlog 240 "${specs[@]}"
h200_tests tlog 200 "test_gpu_engine|tests/python/test_gpu_engine.py"
h200_collect_tests tlog "$OUT/tests.log" "$OUT/bench.log" "$t0"
t0=$(date +%s)
if [ "$PHASE" = a ]; then
  timeout 200 python3 bench/decode_variants.py --out "$OUT" --name cuda-kernels-run7a --timeout 80 \
    --variants kernel,inkernel,kernel2,inkernel2,kernel3,inkernel3 >> "$OUT/bench.log" 2>&1
  echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
  { for v in kernel inkernel kernel inkernel; do PAGEDLLM_SPLITK_COMBINE=$v timeout 40 python3 bench/decode_layer.py; done
  } > decode-layer.jsonl 2>&1
else
  timeout 200 python3 bench/cuda_kernels.py --out "$OUT" --tag run7 >> "$OUT/bench.log" 2>&1
  echo "cuda_kernels: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
  { timeout 40 python3 bench/decode_layer.py; PAGEDLLM_SPLITK_COMBINE=kernel timeout 40 python3 bench/decode_layer.py
    timeout 40 python3 bench/decode_layer.py; } > decode-layer.jsonl 2>&1
fi
grep -h "^SUMMARY" decode-layer.jsonl | tee -a "$OUT/bench.log"
echo "total bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
sed -n '/^variant /,$p' "$OUT/bench.log"
grep -h '"batch"' "$OUT/bench.log" | cut -c1-220 | tail -20
