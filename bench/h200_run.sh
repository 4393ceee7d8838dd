#!/usr/bin/env bash
# One batch on the H200 device machine (see bench/cuda_kernels_notes.md): build the wheel in
# place, run every CUDA test (default kernels, then the alternative decode / prefill variants),
# the kernel benchmarks and an Nsight Compute pass. Everything is logged under $OUT.
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
T="tests/python/test_cuda_kernels.py tests/python/test_attention_kernels.py tests/python/test_cache_ops.py"
t0=$(date +%s)
{ echo "== default kernels"; timeout 240 python3 -m pytest tests/python -m cuda -q -rf -p no:cacheprovider --maxfail=40
  echo "== PAGEDLLM_DECODE_KERNEL=v1 PAGEDLLM_PREFILL_WARPS=4"
  PAGEDLLM_DECODE_KERNEL=v1 PAGEDLLM_PREFILL_WARPS=4 timeout 120 python3 -m pytest $T -m cuda -q -rf -p no:cacheprovider --maxfail=20
  echo "== PAGEDLLM_PREFILL_STAGES=3"
  PAGEDLLM_PREFILL_STAGES=3 timeout 120 python3 -m pytest $T -m cuda -q -rf -p no:cacheprovider --maxfail=20 -k prefill
} > "$OUT/tests.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|error" "$OUT/tests.log" | tail -30
t0=$(date +%s)
timeout 150 python3 bench/cuda_kernels.py ${BENCH_ARGS:-} --out "$OUT" > "$OUT/bench.log" 2>&1
PAGEDLLM_PREFILL_STAGES=3 timeout 60 python3 bench/cuda_kernels.py --prefill-only --tag stages3 --out "$OUT" >> "$OUT/bench.log" 2>&1
if [ -f bench/kernels.py ]; then
  timeout 150 python3 bench/kernels.py --device cuda --machine h200 --out "$OUT" >> "$OUT/bench.log" 2>&1
fi
echo "bench: $(( $(date +%s) - t0 )) s"
grep -E '^\{"(batch|seq)' "$OUT/bench.log" | cut -c1-330
grep -vE '^\{|^ |^\}|^\]' "$OUT/bench.log" | tail -8
if [ -n "${NCU:-1}" ] && command -v ncu > /dev/null; then
  t0=$(date +%s)
  timeout 150 ncu --clock-control none --set detailed -k regex:'paged|splitk' python3 bench/cuda_profile.py > "$OUT/ncu.txt" 2>&1
  echo "ncu: rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "paged_|splitk|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu.txt" | head -60
fi
