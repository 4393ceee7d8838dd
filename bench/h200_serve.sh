#!/usr/bin/env bash
# The server's speed on the H200 (issue 31), one device call of < 10 min:
#   build; a config-only Llama-3-8B folder (random weights: --load-format dummy); then
#   bench/serve.py --offline: the offline engine and `pagedllm serve` (engine in its own process,
#   the default) on the same prompts at 1 / 16 / 64 / 256 concurrent streams of 256 in / 256 out;
#   then the same server with the engine on a thread (PAGEDLLM_ENABLE_MULTIPROCESSING=0).
# The server's packages travel as wheels (.whl, carried; see the device README), since the
# device image has neither fastapi nor pydantic.
#   OUT=/dir NAME=s16a bash bench/h200_serve.sh
set -uo pipefail
OUT=${OUT:?set OUT}
NAME=${NAME:-serve}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
  exit 1
export PYTHONPATH=/tmp/site
source bench/h200_lib.sh
export PAGEDLLM_COMMIT=${PAGEDLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
h200_build "$OUT" | tee "$OUT/summary.log" || exit 1
python3 -c "
import json, pathlib, sys
sys.path.insert(0, 'bench')
from throughput_gpu import SHAPES
d = pathlib.Path('/tmp/llama3-8b'); d.mkdir(exist_ok=True)
(d / 'config.json').write_text(json.dumps(SHAPES['llama3-8b']))
"
ARGS=${ARGS:-"--load-format dummy --dtype bfloat16 --max-num-seqs 256"}
LEVELS=${LEVELS:-"--concurrency 1 16 64 256 --num-prompts 8 64 256 1024"}
COMMON="--server-model /tmp/llama3-8b --input-len 256 --output-len 256 --client-processes 4 $LEVELS"

run() {  # run TAG [serve.py args...]
  local tag=$1 t0
  shift
  t0=$(date +%s)
  timeout 280 python3 bench/serve.py --start-server "$ARGS" $COMMON --label "pagedllm-$tag" \
    --out "$OUT/$NAME-serve-$tag.json" --server-log "$OUT/$NAME-server-$tag.log" "$@" > "$OUT/$NAME-$tag.log" 2>&1
  echo "serve $tag: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
  grep -E "out tok/s|Error|error" "$OUT/$NAME-$tag.log" | grep -v '"error' | head -12 | tee -a "$OUT/summary.log"
  python3 - "$OUT/$NAME-serve-$tag.json" <<'EOF' 2>/dev/null | tee -a "$OUT/summary.log"
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"  c={r['concurrency']}: {r['output_throughput_tok_s']:.0f} tok/s"
          + (f" = {r['fraction_of_offline']:.3f} of offline {r['offline_output_throughput_tok_s']:.0f}"
             f", ITL p99 / TPOT p50 {r['itl_p99_over_tpot_p50']:.2f}" if "fraction_of_offline" in r else "")
          + f", TPOT p50 {r['tpot_ms']['p50']:.2f} ms, ITL p99 {r['itl_ms']['p99']:.2f} ms, errors {r['errors']}")
EOF
}

run mp --offline
PAGEDLLM_ENABLE_MULTIPROCESSING=0 run thread
