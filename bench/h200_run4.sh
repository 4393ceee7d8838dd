#!/usr/bin/env bash
# Run 4 on the H200 device machine (bench/cuda_kernels_notes.md): build two copies of the tree
# in parallel — as is, and with the TMA decode variant compiled out (a fallback should only that
# fail to build) — then every CUDA test with the default kernels, the decode tests again under
# each variant, and the variant benchmark (bench/decode_variants.py). Logs and JSON under $OUT.
#   OUT=/some/dir bash bench/h200_run4.sh [variants]
set -uo pipefail
OUT=${OUT:?set OUT}
VARIANTS=${1:-base,nz,tma,4x5,fused,fused_memset,base2}
export CUDAARCHS=90a PYTHONUNBUFFERED=1
export PAGEDLLM_COMMIT=$(cat COMMIT 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
ROOT=$(pwd)
build() {  # tree, extra CUDA flags
  (cd "$1" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDLLM_PYTHON=ON \
     -DPAGEDLLM_INPLACE=ON -DPAGEDLLM_CUDA=ON -DCMAKE_CUDA_FLAGS="$2" \
     -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" \
     && cmake --build build/dev -j16)
}
t0=$(date +%s)
rm -rf /tmp/treeB && mkdir /tmp/treeB && cp -a "$ROOT"/. /tmp/treeB/
build "$ROOT" "" > "$OUT/build.log" 2>&1 & pa=$!
build /tmp/treeB "-DPAGEDLLM_DECODE_TMA=0" > /tmp/buildB.log 2>&1 & pb=$!
wait $pa; ra=$?; wait $pb; rb=$?
echo "build: $(( $(date +%s) - t0 )) s (full rc=$ra, no-TMA rc=$rb)"
if [ $ra -eq 0 ]; then TREE=$ROOT
elif [ $rb -eq 0 ]; then TREE=/tmp/treeB; echo "FULL BUILD FAILED, using the no-TMA build"; grep -E "error" "$OUT/build.log" | head -20
else grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; fi
cp /tmp/buildB.log "$OUT/buildB.log"
export PYTHONPATH=$TREE/python
cd "$TREE"
PT="-q -rf -p no:cacheprovider --maxfail=10"
t0=$(date +%s)
# Every variant's decode tests must pass before its timings count: failing ones are not benched.
BASE_OK=0; PASSED=""
declare -A ENVS=([nz]="PAGEDLLM_DECODE_V2=nz" [tma]="PAGEDLLM_DECODE_V2=tma" [4x5]="PAGEDLLM_DECODE_V2=4x5"
                 [fused]="PAGEDLLM_SPLITK=fused" [fused_memset]="PAGEDLLM_SPLITK=fused_memset")
{ echo "== default kernels"; timeout 150 python3 -m pytest tests/python -m cuda $PT && BASE_OK=1
  for v in nz tma 4x5 fused fused_memset; do
    case ",$VARIANTS," in *",$v,"*) ;; *) continue ;; esac
    echo "== ${ENVS[$v]} (decode tests)"
    env ${ENVS[$v]} timeout 60 python3 -m pytest tests/python/test_cuda_kernels.py -m cuda $PT -k "decode or graph" \
      && PASSED="$PASSED,$v"
  done
} > "$OUT/tests.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s; default kernels passed: $BASE_OK; variants that passed: $PASSED"
grep -E "^==|passed|failed|error" "$OUT/tests.log" | tail -24
PASSED="base$PASSED,base2"  # the default is timed either way (first and last); notes say if it failed
t0=$(date +%s)
timeout 240 python3 bench/decode_variants.py --out "$OUT" --variants "$PASSED" --timeout 60 2> "$OUT/bench.log"
echo "bench: $(( $(date +%s) - t0 )) s"
