#!/usr/bin/env bash
# One batch on the H200 device machine (see bench/cuda_kernels_notes.md): build the wheel in
# place; run every CUDA test with the default kernels, and the decode tests again with the
# CTA-per-item decode kernel and no programmatic dependent launch; then the kernel benchmarks
# (bench/cuda_kernels.py, bench/kernels.py) and an Nsight Compute pass over the decode kernels.
# Logs and JSON under $OUT (at most 8 files come back from the device tool).
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
T="tests/python/test_cuda_kernels.py tests/python/test_attention_kernels.py"
PT="-q -rf -p no:cacheprovider --maxfail=20"
t0=$(date +%s)
{ echo "== default kernels"; timeout 240 python3 -m pytest tests/python -m cuda $PT
  echo "== PAGEDLLM_NO_PDL=1 PAGEDLLM_DECODE_KERNEL=v1 (decode tests)"
  PAGEDLLM_NO_PDL=1 PAGEDLLM_DECODE_KERNEL=v1 timeout 90 python3 -m pytest $T -m cuda $PT -k "decode or graph"
} > "$OUT/tests.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|error" "$OUT/tests.log" | tail -20
t0=$(date +%s)
timeout 150 python3 bench/cuda_kernels.py --out "$OUT" > "$OUT/bench.log" 2>&1
timeout 150 python3 bench/kernels.py --device cuda --machine h200 --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench: $(( $(date +%s) - t0 )) s"
grep -E '^\{"(batch|seq)' "$OUT/bench.log" | cut -c1-300 | tail -32
if command -v ncu > /dev/null; then
  timeout 90 ncu --clock-control none --set detailed -k regex:'paged_decode|splitk' -c 4 \
    python3 bench/cuda_profile.py > "$OUT/ncu.txt" 2>&1
  grep -E "paged_|splitk|Duration|DRAM Throughput|L2 Cache Throughput|excessive" "$OUT/ncu.txt" | head -30
fi
