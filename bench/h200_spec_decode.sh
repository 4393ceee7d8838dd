#!/bin/bash
# bench/h200_spec_decode.sh — issue 25 (speculative decoding) on the H200, one device call:
#   build; the speculative-decoding tests on the GPU; then bench/throughput.py at batch 1 on the
#   Llama-3-8B shape with random bf16 weights and SmolLM2's tokenizer (49,152-token vocabulary; the
#   input-grounded prompts need a real tokenizer): no speculation against n-gram drafts with the
#   debug accept-all (rejection_sample_method "synthetic", acceptance length k + 1) at k = 2 and 4 —
#   random weights make real acceptance meaningless, so this measures what verification costs:
#   tokens/s, and each engine's median step time (a (k + 1)-token verification step against a
#   1-token decode step).
# Carry .whl (fastapi... as bench/h200_structured_output.sh) and .cache-pagedllm (SmolLM2's
# tokenizer). Results and logs under $OUT.
set -uo pipefail
source bench/h200_lib.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
  exit 1
export PYTHONPATH=/tmp/site PAGEDLLM_CACHE=$PWD/.cache-pagedllm
h200_build "$OUT"
t0=$(date +%s)
timeout 300 python3 -m pytest -q -rf -p no:cacheprovider tests/python/test_spec_decode.py tests/python/test_gpu_engine.py -m cuda > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
h200_smollm2_vocab_model
spec() { echo "{\"method\": \"ngram\", \"num_speculative_tokens\": $1, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4, \"rejection_sample_method\": \"synthetic\", \"synthetic_acceptance_length\": $(( $1 + 1 ))}"; }
for n in ${LEVELS:-1}; do
  t0=$(date +%s)
  timeout 420 python3 bench/throughput.py --model /tmp/llama3-8b-shape-smollm2-vocab --load-format dummy --skip-hf \
    --dtype bfloat16 --dataset input-grounded --ignore-eos --num-prompts "$n" --output-len 256 --kv-bytes 8589934592 \
    --max-model-len 1024 --threads 8 --speculative-config none "$(spec 2)" "$(spec 4)" --rounds 3 --warmup-rounds 1 \
    --pause 0.5 --name "h200-spec-decode-n$n" --results-dir "$OUT" > "$OUT/bench-n$n.log" 2>&1
  echo "n=$n rc=$? in $(( $(date +%s) - t0 )) s"
  python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))
for k in ('pagedllm', 'pagedllm_spec1', 'pagedllm_spec2'):
    e = r.get(k, {}); print(k, {x: e.get(x) for x in ('output_tok_s', 'step_ms_median', 'steps', 'output_tokens', 'spec_decode_mean_accepted', 'error')})
print({k: v for k, v in r.items() if k.startswith('ratio_pagedllm_spec') and not k.endswith('rounds')})" "$OUT/$(date +%F)-$(hostname)-h200-spec-decode-n$n.json" 2>&1 | tail -5
done
# the step time of a (k + 1)-token verification against a 1-token decode, each engine step one whole
# step (async scheduling off), batch 1
t0=$(date +%s)
timeout 300 python3 bench/throughput.py --model /tmp/llama3-8b-shape-smollm2-vocab --load-format dummy --skip-hf \
  --dtype bfloat16 --dataset input-grounded --ignore-eos --num-prompts 1 --output-len 256 --kv-bytes 8589934592 \
  --max-model-len 1024 --threads 8 --speculative-config none "$(spec 4)" --async-scheduling false --rounds 3 \
  --warmup-rounds 1 --pause 0.5 --name "h200-spec-decode-sync-n1" --results-dir "$OUT" > "$OUT/bench-sync-n1.log" 2>&1
echo "sync n=1 rc=$? in $(( $(date +%s) - t0 )) s"
python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))
for k in ('pagedllm', 'pagedllm_spec'):
    e = r.get(k, {}); print(k, {x: e.get(x) for x in ('output_tok_s', 'step_ms_median', 'steps', 'error')})
print({k: v for k, v in r.items() if k.startswith('ratio_pagedllm_spec') and not k.endswith('rounds')})" "$OUT/$(date +%F)-$(hostname)-h200-spec-decode-sync-n1.json" 2>&1 | tail -3
