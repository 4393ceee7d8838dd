#!/usr/bin/env bash
# One batch on the H200 device machine (see bench/cuda_kernels_notes.md): build the wheel in
# place, run every CUDA test, then the kernel benchmarks. Everything is logged under $OUT.
#   OUT=/some/dir bash bench/h200_run.sh
set -uo pipefail
OUT=${OUT:?set OUT}
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 330 python3 -m pytest tests/python -m cuda -q -rf -p no:cacheprovider --maxfail=40 \
  > "$OUT/tests.log" 2>&1
echo "tests: rc=$? $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/tests.log"
t0=$(date +%s)
timeout 150 python3 bench/cuda_kernels.py ${BENCH_ARGS:-} --out "$OUT" > "$OUT/bench.log" 2>&1
PAGEDLLM_PREFILL_WARPS=8 timeout 60 python3 bench/cuda_kernels.py --prefill-only --out "$OUT" >> "$OUT/bench.log" 2>&1
if [ -f bench/kernels.py ]; then
  timeout 120 python3 bench/kernels.py --device cuda --out "$OUT" >> "$OUT/bench.log" 2>&1
fi
echo "bench: $(( $(date +%s) - t0 )) s"
grep -E '^\{"(batch|seq)' "$OUT/bench.log" | cut -c1-400
grep -vE '^\{|^ |^\}' "$OUT/bench.log" | tail -15
