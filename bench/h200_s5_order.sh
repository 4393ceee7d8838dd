#!/usr/bin/env bash
# Session 5, call 2 (bench/cuda_kernels_notes.md "Run 8"): work items with the KV head fastest
# (PAGEDLLM_DECODE_ORDER=heads) against the default order, the single-pass plans of 64 x 4,096 again,
# and the launch floor of a split decode (1 x 16). Build; the kernel file's default tests and its
# decode tests under the heads order (reduction kernel and in-kernel combine); the variants
# (bench/decode_variants.py).   OUT=/some/dir bash bench/h200_s5_order.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s5-run8b}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
h200_build "$OUT" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
SEL="'(decode or graph or combine or empty) and not forced_plans and not fallbacks'"
t0=$(date +%s)
rm -rf tlog
h200_tests tlog 300 "kernels|$K -k 'not forced_plans'" &
( export PAGEDLLM_DECODE_ORDER=heads; h200_tests tlog 300 "heads-kernel|$K -k $SEL" ) &
( export PAGEDLLM_DECODE_ORDER=heads PAGEDLLM_SPLITK_COMBINE=inkernel; h200_tests tlog 300 "heads-inkernel|$K -k $SEL" ) &
( export PAGEDLLM_DECODE_ORDER=heads PAGEDLLM_SPLITK_COMBINE=inkernel PAGEDLLM_DECODE_MODE=cta; h200_tests tlog 300 "heads-cta-inkernel|$K -k $SEL" ) &
wait
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/$NAME-tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
h200_test_summary tlog | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 400 python3 bench/decode_variants.py --out "$OUT" --name "cuda-kernels-$NAME" --timeout 90 \
  --variants base2,heads2,pair2,cta2,heads,base,floor,floorin >> "$OUT/bench.log" 2>&1
echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
sed -n '/^variant /,$p' "$OUT/bench.log"
