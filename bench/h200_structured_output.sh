#!/bin/bash
# bench/h200_structured_output.sh — issue 24 (structured outputs) on the H200, one device call:
#   build; the structured-output tests on the GPU (the sampler's mask against the CPU's, the engine
#   under CUDA graphs with sync and async scheduling); then bench/throughput.py --structured-outputs
#   none json at 1, 16 and 64 concurrent requests (256 in / 256 out) on the Llama-3-8B shape with
#   random bf16 weights and SmolLM2's tokenizer and 49,152-token vocabulary (a grammar needs real
#   token text; Llama 3's tokenizer is not on the machine).
# Carry .whl (xgrammar, apache-tvm-ffi, jsonschema and its needs) and .cache-pagedllm (SmolLM2's
# tokenizer, from ~/.cache/pagedllm/test-tokenizers). Results and logs under $OUT.
set -uo pipefail
source bench/h200_lib.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
  exit 1
export PYTHONPATH=/tmp/site PAGEDLLM_CACHE=$PWD/.cache-pagedllm
h200_build "$OUT"
t0=$(date +%s)
timeout 300 python3 -m pytest -q -rf -p no:cacheprovider tests/python/test_sampler_grammar.py \
  tests/python/test_structured_output.py -k "cuda or mask_matches or start_grammar or stop_token" > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
h200_smollm2_vocab_model
for n in ${LEVELS:-1 16 64}; do
  t0=$(date +%s)
  timeout 420 python3 bench/throughput.py --model /tmp/llama3-8b-shape-smollm2-vocab --load-format dummy --skip-hf \
    --dtype bfloat16 --num-prompts "$n" --input-len 256 --output-len 256 --kv-bytes 8589934592 --max-model-len 1024 \
    --threads 8 --structured-outputs none json --rounds 3 --warmup-rounds 1 --pause 0.5 \
    --name "h200-structured-outputs-n$n" --results-dir "$OUT" > "$OUT/bench-n$n.log" 2>&1
  echo "n=$n rc=$? in $(( $(date +%s) - t0 )) s"
  python3 -c "
import json, sys; r = json.load(open(sys.argv[1]))
for k in ('pagedllm', 'pagedllm_json'):
    e = r.get(k, {}); print(k, {x: e.get(x) for x in ('output_tok_s', 'step_ms_median', 'grammar_ms_per_step', 'grammar_compile_ms', 'output_tokens')})
print('ratio', r.get('ratio_pagedllm_json_vs_pagedllm'))" "$OUT/$(date +%F)-$(hostname)-h200-structured-outputs-n$n.json" 2>&1 | tail -4
done
# the sampler alone: greedy vs json rows (the fill by thread count), on the GPU's logits
PYTHONPATH=python:$PYTHONPATH timeout 120 python3 bench/sampler.py --rows 16 64 256 --mixes greedy temperature json --device cuda \
  --threads 8 --tokenizer .cache-pagedllm/test-tokenizers/smollm2-135m-instruct > "$OUT/sampler.log" 2>&1
echo "sampler rc=$?"; cp bench/results/*-sampler.json "$OUT/" 2>/dev/null
python3 -c "
import json, glob; r = json.load(open(sorted(glob.glob('bench/results/*-sampler.json'))[-1]))
for k, v in r['results'].items(): print(k, v)"
