#!/usr/bin/env bash
# Run 5 (kern3), one device call (run twice: 5a with the first candidate, 5b with the final code) (bench/cuda_kernels_notes.md "Run 5"): build this tree in place;
# the CUDA tests of the attention and layer-op kernels and the GPU engine with the default choices,
# and the decode tests again under each forced choice (v2 work items on warps / pairs of warps / CTAs, fixed
# partitions + run 4's reduction, the warp-row reduction at any split count without PDL), in parallel; then the decode variants side by side
# (bench/decode_variants.py: graph replay, SDPA in the same process) and the engine-shaped batch-1
# layer benchmark (bench/decode_layer.py) and bench/kernels.py --device cuda. At most 8 files come back: gpu.txt, tests.log,
# bench.log, the variants JSON, decode-layer.jsonl, bench/kernels.py's JSON. (The device image lacks fastapi / openai:
# only CUDA test files are named.)
#   OUT=/some/dir bash bench/h200_run5.sh
set -uo pipefail
OUT=${OUT:?set OUT}
export CUDAARCHS=90a PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
(cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDLLM_PYTHON=ON -DPAGEDLLM_INPLACE=ON \
   -DPAGEDLLM_CUDA=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" \
   && cmake --build build/dev -j16) > build.log 2>&1 || { grep -E "error" build.log | head -20; tail -20 build.log; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
PT="-q -rf -p no:cacheprovider --maxfail=10"
t0=$(date +%s)
mkdir -p tlog
( timeout 200 python3 -m pytest $K tests/python/test_attention_kernels.py tests/python/test_layer_ops_cuda.py \
    tests/python/test_cache_ops.py -m cuda $PT > tlog/default.log 2>&1; echo "rc=$?" >> tlog/default.log ) &
( timeout 200 python3 -m pytest tests/python/test_gpu_engine.py -m cuda $PT > tlog/engine.log 2>&1; echo "rc=$?" >> tlog/engine.log ) &
for v in PAGEDLLM_DECODE_MODE=cta PAGEDLLM_DECODE_MODE=pair PAGEDLLM_DECODE_MODE=warp \
         "PAGEDLLM_DECODE_EVEN=0 PAGEDLLM_REDUCE=cta" "PAGEDLLM_REDUCE=warp PAGEDLLM_NO_PDL=1"; do
  n=$(echo "$v" | tr ' =' '__')
  ( env $v timeout 150 python3 -m pytest $K -m cuda $PT -k "decode or graph" > "tlog/$n.log" 2>&1; echo "rc=$?" >> "tlog/$n.log" ) &
done
wait
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
for f in tlog/*.log; do echo "== $f: $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"; done | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 200 python3 bench/decode_variants.py --out "$OUT" --name kernels-run5 --timeout 60 >> "$OUT/bench.log" 2>&1
echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 90 python3 bench/kernels.py --device cuda --machine h200 --out "$OUT" > kernels-py.log 2>&1
echo "kernels.py: $(( $(date +%s) - t0 )) s rc=$?" | tee -a "$OUT/bench.log"; tail -3 kernels-py.log >> "$OUT/bench.log"
t0=$(date +%s)
{ timeout 40 python3 bench/decode_layer.py
  PAGEDLLM_DECODE_MODE=warp PAGEDLLM_DECODE_EVEN=0 PAGEDLLM_REDUCE=cta timeout 40 python3 bench/decode_layer.py
  timeout 40 python3 bench/decode_layer.py --max-model-len 4096
} > "$OUT/decode-layer.jsonl" 2>&1
echo "decode_layer: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
grep -h "^SUMMARY" "$OUT/decode-layer.jsonl"
sed -n '/^variant /,$p' "$OUT/bench.log"
