#!/usr/bin/env bash
# Session 5, call 4 (bench/cuda_kernels_notes.md "Run 8"): the merged decisions of run 8c (in-kernel
# combine with the acquire-release arrival for CTA items up to 16 partitions) tested and timed, and
# 2-deep TMA rings (PAGEDLLM_DECODE_STAGES=2) against the 3-deep default. Build; the kernel file's
# default tests and every forced-plan child, the attention file; the variants; cuda_kernels --quick.
#   OUT=/some/dir bash bench/h200_s5_stages.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s5-run8d}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
h200_build "$OUT" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
t0=$(date +%s)
rm -rf tlog
specs=("kernels|$K -k 'not forced_plans'" "attention|tests/python/test_attention_kernels.py")
for id in warp-warp-kernel pair-cta-kernel cta-warp-kernel cta-cta-kernel warp-warp-inkernel pair-warp-inkernel cta-warp-inkernel; do
  specs+=("forced-$id|$K -k 'forced_plans and $id'")
done
h200_tests tlog 300 "${specs[@]}"
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/$NAME-tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
h200_test_summary tlog | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 300 python3 bench/decode_variants.py --out "$OUT" --name "cuda-kernels-$NAME" --timeout 90 \
  --variants base3,stages2,base2,stages2b >> "$OUT/bench.log" 2>&1
echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
timeout 100 python3 bench/cuda_kernels.py --quick --tag "$NAME" --out "$OUT" > "$OUT/$NAME-kernels.log" 2>&1
echo "cuda_kernels --quick: rc=$?" | tee -a "$OUT/bench.log"
sed -n '/^variant /,$p' "$OUT/bench.log"
grep -h '"batch"\|"tflops\|speed_vs' "$OUT/$NAME-kernels.log" | tail -12
