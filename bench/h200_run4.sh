#!/usr/bin/env bash
# Run 4, second device call (bench/cuda_kernels_notes.md): two trees built in parallel —
# $1 = the candidate, $2 = a fallback differing in one change (for the A/B and in case the
# candidate fails) — then all CUDA tests of both (the candidate's decode tests also under
# PAGEDLLM_DECODE_TMA=0 and PAGEDLLM_DECODE_KERNEL=v1), the kernel benchmark of the candidate,
# the A/B rows, and Nsight Compute on the decode kernels. Each tree holds a COMMIT file.
# (fastapi / openai are missing on the device image: only the CUDA test files are collected.)
#   OUT=/some/dir bash bench/h200_run4.sh CANDIDATE_TREE FALLBACK_TREE
set -uo pipefail
OUT=${OUT:?set OUT}
F=$(realpath "$1"); T=$(realpath "$2")
export CUDAARCHS=90a PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  echo "final tree $(cat "$F/COMMIT"), fallback tree $(cat "$T/COMMIT")"; } > "$OUT/bench.log" 2>&1
build() {  # tree
  (cd "$1" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDLLM_PYTHON=ON \
     -DPAGEDLLM_INPLACE=ON -DPAGEDLLM_CUDA=ON -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
     -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build/dev -j16) > "$1/build.log" 2>&1
}
t0=$(date +%s)
build "$F" & pf=$!; build "$T" & pt=$!
wait $pf; rf=$?; wait $pt; rt=$?
echo "build: $(( $(date +%s) - t0 )) s (final rc=$rf, fallback rc=$rt)" | tee -a "$OUT/bench.log"
for x in "$F" "$T"; do grep -E "error" "$x/build.log" | head -10 >> "$OUT/bench.log"; done
FILES="tests/python/test_attention_kernels.py tests/python/test_cuda_kernels.py tests/python/test_cache_ops.py
       tests/python/test_sampler.py tests/python/test_gpu_engine.py"
PT="-q -rf -p no:cacheprovider --maxfail=10"
tests() {  # tree, log
  cd "$1" && export PYTHONPATH=$1/python PAGEDLLM_COMMIT=$(cat COMMIT) && {
    echo "== $(cat COMMIT): default kernels"; timeout 150 python3 -m pytest $FILES -m cuda $PT; echo "rc=$?"
    if [ "$1" = "$F" ]; then
      for v in PAGEDLLM_DECODE_TMA=0 PAGEDLLM_DECODE_KERNEL=v1; do
        echo "== $v (decode tests)"
        env $v timeout 60 python3 -m pytest tests/python/test_cuda_kernels.py -m cuda $PT -k "decode or graph"; echo "rc=$?"
      done
    fi
  } > "$2" 2>&1
}
t0=$(date +%s)
[ $rf -eq 0 ] && { tests "$F" "$OUT/tests-final.log" & }
[ $rt -eq 0 ] && tests "$T" "$OUT/tests-fallback.log"
wait
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
grep -hE "^==|passed|failed|rc=" "$OUT"/tests-*.log | tee -a "$OUT/bench.log"
t0=$(date +%s)
if [ $rf -eq 0 ]; then
  cd "$F"; export PYTHONPATH=$F/python PAGEDLLM_COMMIT=$(cat COMMIT)
  timeout 120 python3 bench/cuda_kernels.py --out "$OUT" --tag run4-final 2>> "$OUT/bench.log" > /dev/null
  timeout 60 python3 bench/decode_variants.py --out "$OUT" --variants cpasync,base2 --name kernels-run4-final-ab \
    --timeout 40 >> "$OUT/bench.log" 2>&1
fi
if [ $rt -eq 0 ]; then
  cd "$T"; export PYTHONPATH=$T/python PAGEDLLM_COMMIT=$(cat COMMIT)
  timeout 50 python3 bench/decode_variants.py --out "$OUT" --variants base --cases 1x4096,8x4096,16x1024,64x4096 \
    --name kernels-run4-mallocasync --timeout 40 >> "$OUT/bench.log" 2>&1
fi
echo "bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
python3 - "$OUT/bench.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith('{"batch') and not line.startswith('{"seq'):
        continue
    r = json.loads(line)
    if "batch" in r:
        print("%sx%s s=%s %s ours %s sdpa %s ratio %s" % (r["batch"], r["context"], r["split_k"], r["block_ids"][:3],
                                                       r["ours_us"], r["sdpa_us"], r["speed_vs_sdpa"]))
    else:
        print("prefill %s ours %s TF/s sdpa %s ratio %s" % (r["seq"], r["ours_TFLOPs"], r["sdpa_TFLOPs"], r["ratio_vs_sdpa"]))
PY
if [ $rf -eq 0 ] && command -v ncu > /dev/null; then
  cd "$F"; export PYTHONPATH=$F/python
  timeout 45 ncu --clock-control none --set detailed -k regex:'paged_decode|splitk' -c 3 \
    python3 bench/cuda_profile.py > "$OUT/ncu.txt" 2>&1
  grep -E "paged_|splitk|Duration|DRAM Throughput|L2 Cache Throughput|excessive" "$OUT/ncu.txt" | head -24
fi
