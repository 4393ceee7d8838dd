#!/usr/bin/env bash
# One batch on the H200 device machine (see bench/cuda_kernels_notes.md): build the wheel in
# place; run every CUDA test with the default kernels and the decode tests with each alternative
# decode configuration; time the decode configurations (quick grid), pick the fastest, then run
# the full benchmarks (bench/cuda_kernels.py and bench/kernels.py) with it, and an Nsight Compute
# pass over the decode kernel. Logs and JSON under $OUT.
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
  for v in 4x3bulk 2x6 3x4 4x3pf256 4x3nopf; do
    echo "== PAGEDLLM_DECODE_V2=$v (decode tests)"
    PAGEDLLM_DECODE_V2=$v timeout 90 python3 -m pytest $T -m cuda $PT -k "decode or graph"
  done
  echo "== PAGEDLLM_NO_PDL=1 PAGEDLLM_DECODE_KERNEL=v1 (decode tests)"
  PAGEDLLM_NO_PDL=1 PAGEDLLM_DECODE_KERNEL=v1 timeout 90 python3 -m pytest $T -m cuda $PT -k "decode or graph"
} > "$OUT/tests.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s"; grep -E "^==|passed|failed|error" "$OUT/tests.log" | tail -30
t0=$(date +%s)
mkdir -p /tmp/variants
for v in 4x3 4x3bulk 4x3nopf 4x3pf256 2x6 3x4; do
  PAGEDLLM_DECODE_V2=$v timeout 60 python3 bench/cuda_kernels.py --quick --no-prefill --tag "$v" --out /tmp/variants >> "$OUT/bench.log" 2>&1
done
BEST=$(python3 - <<'PY'
import glob, json
rows = {}
for f in glob.glob("/tmp/variants/*.json"):
    d = json.load(open(f)); v = d["variant"].get("PAGEDLLM_DECODE_V2", "4x3")
    t = {(r["batch"], r["context"]): r["ours_us"] for r in d["decode"]}
    rows[v] = (t[(64, 4096)], t[(1, 4096)])
b64 = min(r[0] for r in rows.values()); b1 = min(r[1] for r in rows.values())
for v, r in sorted(rows.items()):
    print(f"variant {v}: 64x4096 {r[0]} us, 1x4096 {r[1]} us", file=__import__("sys").stderr)
print(min(rows, key=lambda v: rows[v][0] / b64 + 0.5 * rows[v][1] / b1))
PY
)
echo "decode variants: $(( $(date +%s) - t0 )) s"
echo "best decode configuration: $BEST" | tee -a "$OUT/bench.log"
export PAGEDLLM_DECODE_V2=$BEST
t0=$(date +%s)
timeout 150 python3 bench/cuda_kernels.py --out "$OUT" >> "$OUT/bench.log" 2>&1
timeout 150 python3 bench/kernels.py --device cuda --machine h200 --out "$OUT" >> "$OUT/bench.log" 2>&1
echo "bench: $(( $(date +%s) - t0 )) s"
grep -E '^\{"(batch|seq)' "$OUT/bench.log" | cut -c1-300 | tail -32
if command -v ncu > /dev/null; then
  timeout 90 ncu --clock-control none --set detailed -k regex:'paged_decode_v2|splitk' -c 4 \
    python3 bench/cuda_profile.py > "$OUT/ncu.txt" 2>&1
  grep -E "paged_|splitk|Duration|DRAM Throughput|L2 Cache Throughput|excessive" "$OUT/ncu.txt" | head -30
fi
