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
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1 || { cp build.log "$OUT/"; grep -E "error" build.log | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
PT="-q -rf -p no:cacheprovider --maxfail=10 -m cuda"
mkdir -p tlog && rm -f tlog/*.log
t0=$(date +%s)
( timeout 240 python3 -m pytest $K $PT -k "not forced_plans" > tlog/kernels.log 2>&1; echo "rc=$?" >> tlog/kernels.log ) &
for id in warp-warp-kernel pair-cta-kernel cta-warp-kernel cta-cta-kernel warp-warp-inkernel pair-warp-inkernel cta-warp-inkernel; do
  ( timeout 240 python3 -m pytest $K $PT -k "forced_plans and $id" > "tlog/forced-$id.log" 2>&1; echo "rc=$?" >> "tlog/forced-$id.log" ) &
done
for f in test_attention_kernels test_cache_ops test_layer_ops_cuda test_gemv; do
  ( timeout 240 python3 -m pytest tests/python/$f.py $PT > "tlog/$f.log" 2>&1; echo "rc=$?" >> "tlog/$f.log" ) &
done
wait
( timeout 200 python3 -m pytest tests/python/test_gpu_engine.py $PT > tlog/test_gpu_engine.log 2>&1; echo "rc=$?" >> tlog/test_gpu_engine.log )
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
for f in tlog/*.log; do echo "== $f: $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"; done | tee -a "$OUT/bench.log"
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
