#!/usr/bin/env bash
# Session 5, call 1 (bench/cuda_kernels_notes.md "Run 8"): the cluster split-K combine for CTA items
# and TMA L2-promotion variants. Build; the kernel file's default tests and its forced-plan children
# for CTA items (cluster, in-kernel and reduction-kernel combines) in parallel; the decode variants
# side by side (bench/decode_variants.py); the engine-shaped batch-1 layer (bench/decode_layer.py)
# under each combine.   OUT=/some/dir bash bench/h200_s5_cluster.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-s5-run8}
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
h200_build "$OUT" | tee "$OUT/bench.log"
K=tests/python/test_cuda_kernels.py
t0=$(date +%s)
rm -rf tlog
h200_tests tlog 300 "kernels|$K -k 'not forced_plans'" \
  "forced-cluster|$K -k 'forced_plans and cta-warp-cluster'" "forced-ctainkernel|$K -k 'forced_plans and cta-warp-inkernel'" \
  "forced-ctakernel|$K -k 'forced_plans and cta-warp-kernel'" "attention|tests/python/test_attention_kernels.py"
for f in tlog/*.log; do echo "== $f"; cat "$f"; done > "$OUT/$NAME-tests.log"
echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
h200_test_summary tlog | tee -a "$OUT/bench.log"
t0=$(date +%s)
timeout 330 python3 bench/decode_variants.py --out "$OUT" --name "cuda-kernels-$NAME" --timeout 90 \
  --variants base,cluster,ctakernel,ctainkernel,cluster2,promo_none,promo64,promo256,base2 >> "$OUT/bench.log" 2>&1
echo "variants: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
{ for v in cluster inkernel kernel cluster inkernel; do
    PAGEDLLM_DECODE_MODE=cta PAGEDLLM_SPLITK_COMBINE=$v timeout 40 python3 bench/decode_layer.py --tag "$v"; done
} > decode-layer.jsonl 2>&1
grep -h "^SUMMARY" decode-layer.jsonl | tee -a "$OUT/bench.log"
echo "total bench: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
sed -n '/^variant /,$p' "$OUT/bench.log"
