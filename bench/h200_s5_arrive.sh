#!/usr/bin/env bash
# Session 5, call 3 (bench/cuda_kernels_notes.md "Run 8"): the in-kernel combine's arrival by one
# acquire-release atomic after the team barrier (the new default) against a fence per thread
# (PAGEDLLM_SPLITK_ARRIVE=fence) and the reduction kernel, on CTA and warp items; block size 32 at
# 64 x 4,096 and 1 x 4,096. Build; the kernel file's default tests and its in-kernel forced-plan
# children; the variants; the engine-shaped batch-1 layer under both arrivals.
#   OUT=/some/dir bash bench/h200_s5_arrive.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s5-run8c}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
h200_build "$OUT" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
SEL="'(decode or graph or combine or empty) and not forced_plans and not fallbacks'"
t0=$(date +%s)
rm -rf tlog
h200_tests tlog 300 "kernels|$K -k 'not forced_plans'" "forced-warp-in|$K -k 'forced_plans and warp-warp-inkernel'" \
  "forced-pair-in|$K -k 'forced_plans and pair-warp-inkernel'" "forced-cta-in|$K -k 'forced_plans and cta-warp-inkernel'" &
( export PAGEDLLM_DECODE_ORDER=heads PAGEDLLM_SPLITK_COMBINE=inkernel; h200_tests tlog 300 "heads-inkernel|$K -k $SEL" ) &
wait
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/$NAME-tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
h200_test_summary tlog | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 400 python3 bench/decode_variants.py --out "$OUT" --name "cuda-kernels-$NAME" --timeout 90 \
  --variants ctain,ctainfence,ctakern,warpin,warpinfence,warpkern,bs32 >> "$OUT/bench.log" 2>&1
echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
{ for v in acqrel fence acqrel fence; do
    if [ $v = fence ]; then export PAGEDLLM_SPLITK_ARRIVE=fence; else unset PAGEDLLM_SPLITK_ARRIVE; fi
    timeout 40 python3 bench/decode_layer.py --tag "$v"; done
} > decode-layer.jsonl 2>&1
grep -h "^SUMMARY" decode-layer.jsonl | tee -a "$OUT/bench.log"
sed -n '/^variant /,$p' "$OUT/bench.log"
