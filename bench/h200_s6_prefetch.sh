#!/usr/bin/env bash
# Session 6 experiment (issue 7, batch 1): the O projection's weight prefetched into L2 during
# rotary + decode attention, with the prefetch issued after the PDL wait (so it overlaps attention,
# not the qkv GEMV). One call: build; test_gemv's l2_prefetch tests; bench/batch1_breakdown.py with
# PAGEDLLM_L2_PREFETCH=0 / 1 alternating (each its own process).
#   OUT=/some/dir PAGEDLLM_COMMIT=<sha> bash bench/h200_s6_prefetch.sh
set -uo pipefail
OUT=${OUT:?set OUT}
source bench/h200_lib.sh
h200_build "$OUT" | tee "$OUT/summary.log" || exit 1
timeout 120 python3 -m pytest tests/python/test_gemv.py -k "prefetch" $H200_PYTEST > "$OUT/tests.log" 2>&1
echo "test_gemv -k prefetch: rc=$? $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.log"
for run in a b; do
  for pf in 0 1; do
    t0=$(date +%s)
    PAGEDLLM_L2_PREFETCH=$pf timeout 100 python3 bench/batch1_breakdown.py --out "$OUT" \
      --name "batch1_breakdown-s6-prefetch$pf-$run" > "$OUT/b1-$pf-$run.log" 2>&1
    echo "prefetch=$pf run $run: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(d[k],1) for k in ('token_us','graph_us','host_gap_us')})" \
      "$OUT/"*"batch1_breakdown-s6-prefetch$pf-$run.json" 2>&1 | tee -a "$OUT/summary.log"
  done
done
# then the CUDA test files that gpudedupe (a42f029) touched, in parallel
t0=$(date +%s)
rm -rf tlog
h200_tests tlog 200 "test_gemv|tests/python/test_gemv.py" "test_layer_ops_cuda|tests/python/test_layer_ops_cuda.py"
h200_collect_tests tlog "$OUT/tests-dedupe.log" "$OUT/summary.log" "$t0"
