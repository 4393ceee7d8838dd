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
run1() {  # run1 TAG ENV...: one batch1_breakdown process under ENV
  local tag=$1 t0; shift
  t0=$(date +%s)
  env "$@" timeout 100 python3 bench/batch1_breakdown.py --out "$OUT" --name "batch1_breakdown-s6-$tag" > "$OUT/b1-$tag.log" 2>&1
  echo "$tag ($*): rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: round(d[k],1) for k in ('token_us','graph_us','host_gap_us')})" \
    "$OUT/"*"batch1_breakdown-s6-$tag.json" 2>&1 | tee -a "$OUT/summary.log"
}
run1 off-a PAGEDLLM_L2_PREFETCH=0
run1 line-a PAGEDLLM_L2_PREFETCH=1
run1 off-b PAGEDLLM_L2_PREFETCH=0
run1 line-b PAGEDLLM_L2_PREFETCH=1
run1 bulk-early PAGEDLLM_L2_PREFETCH=1 PAGEDLLM_L2_PREFETCH_MODE=bulk PAGEDLLM_L2_PREFETCH_EARLY=1
run1 line-early PAGEDLLM_L2_PREFETCH=1 PAGEDLLM_L2_PREFETCH_EARLY=1
rm -f "$OUT"/*host-profile.txt
# then the CUDA test files that gpudedupe (a42f029) touched, in parallel
t0=$(date +%s)
rm -rf tlog
h200_tests tlog 200 "test_gemv|tests/python/test_gemv.py" "test_layer_ops_cuda|tests/python/test_layer_ops_cuda.py"
h200_collect_tests tlog "$OUT/tests-dedupe.log" "$OUT/summary.log" "$t0"
