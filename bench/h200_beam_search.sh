#!/usr/bin/env bash
# bench/h200_beam_search.sh — one device call: build, the beam-search CUDA tests and the GPU engine
# tests (regression), logs under $OUT.
set -uo pipefail
source bench/h200_lib.sh
h200_build "$OUT"
T0=$(date +%s)
h200_tests "$OUT/tests" 420 \
  "beam|tests/python/test_beam_search.py" \
  "gpu_engine|tests/python/test_gpu_engine.py"
h200_collect_tests "$OUT/tests" "$OUT/tests_all.log" "$OUT/summary.txt" "$T0"
