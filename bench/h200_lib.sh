# bench/h200_lib.sh — shell helpers shared by the H200 device batch scripts (source it; bash).
#   h200_build OUT             install this tree in place (pip -e, CUDAARCHS=90a); on failure copy
#                              build.log to OUT, print its errors and exit 1
#   h200_tests LOGDIR T SPEC.. run each SPEC = "name|pytest arguments" (shell words, quotes kept)
#                              as its own pytest process,
#                              all in parallel, each under `timeout T`; logs LOGDIR/name.log end with rc=N
#   h200_test_summary LOGDIR   one line per log: the pytest result line and the exit status
#   h200_collect_tests LOGDIR ALL SUMMARY T0
#                              every log into ALL, then the seconds since T0 and the per-log
#                              summary appended to SUMMARY (and printed)
#   h200_smollm2_vocab_model   writes /tmp/llama3-8b-shape-smollm2-vocab: the Llama-3-8B shape
#                              (bench/throughput_gpu.py SHAPES) with SmolLM2's 49,152-token
#                              vocabulary and tokenizer (from .cache-pagedllm), for --load-format dummy
#   h200_kernel_specs          sets the array H200_SPECS to test_cuda_kernels.py's default tests
#                              and each of its forced-plan children, as pytest collects them (the
#                              specs for h200_tests)
export CUDAARCHS=${CUDAARCHS:-90a} PYTHONUNBUFFERED=1
H200_PYTEST="-q -rf -p no:cacheprovider --maxfail=10 -m cuda"

h200_build() {
  local out=$1 t0
  t0=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1 ||
    { cp build.log "$out/"; grep -E "error" build.log | head -30; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s (${PAGEDLLM_COMMIT:-unknown})"
}

h200_tests() {
  local dir=$1 limit=$2 spec name args
  shift 2
  mkdir -p "$dir"
  for spec in "$@"; do
    name=${spec%%|*}
    args=${spec#*|}
    # eval: the arguments are shell words, quotes included (-k 'not slow')
    ( eval "timeout $limit python3 -m pytest $args $H200_PYTEST" > "$dir/$name.log" 2>&1; echo "rc=$?" >> "$dir/$name.log" ) &
  done
  wait
}

h200_test_summary() {
  local f
  for f in "$1"/*.log; do echo "== $f: $(grep -E 'passed|failed|error' "$f" | tail -1) $(tail -1 "$f")"; done
}

h200_kernel_specs() {
  local k=tests/python/test_cuda_kernels.py id
  H200_SPECS=("kernels|$k -k 'not forced_plans'")
  # one spec per forced-plan child, by the ids pytest collects (test_decode_under_forced_plans)
  for id in $(python3 -m pytest "$k" --collect-only -q -p no:cacheprovider -m cuda -k forced_plans 2>/dev/null |
              sed -n 's/.*::test_decode_under_forced_plans\[\(.*\)\]$/\1/p'); do
    H200_SPECS+=("forced-$id|$k -k 'forced_plans and $id'")
  done
}

h200_collect_tests() {
  local dir=$1 all=$2 summary=$3 t0=$4 f
  for f in "$dir"/*.log; do echo "== $f"; cat "$f"; done > "$all"
  echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  h200_test_summary "$dir" | tee -a "$summary"
}

h200_smollm2_vocab_model() {
  python3 - <<'PY'
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, "bench")
from throughput_gpu import SHAPES
folder = Path("/tmp/llama3-8b-shape-smollm2-vocab")
folder.mkdir(exist_ok=True)
cfg = dict(SHAPES["llama3-8b"], vocab_size=49152, bos_token_id=1, eos_token_id=2)
(folder / "config.json").write_text(json.dumps(cfg))
tok = Path(".cache-pagedllm/test-tokenizers/smollm2-135m-instruct")
for f in tok.iterdir():
    shutil.copy(f, folder / f.name)
PY
}
