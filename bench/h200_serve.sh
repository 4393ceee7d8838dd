#!/usr/bin/env bash
# The server's speed on the H200 (issue 31), one device call of < 10 min:
#   build; a config-only Llama-3-8B folder (random weights: --load-format dummy); then
#   bench/serve.py --offline: the offline engine and `pagedllm serve` (engine in its own process,
#   the default) on the same prompts at 1 / 16 / 64 / 256 concurrent streams of 256 in / 256 out;
#   then the same server with the engine on a thread (PAGEDLLM_ENABLE_MULTIPROCESSING=0) (STAGE=all;
#   STAGE=mp: the first part only; STAGE=asc: --offline with 2 API server processes, then 4).
#   STAGE=profile: the server under 64 then 256 streams, its
#   processes' CPU use per level and 8 s of py-spy samples of the front end and of the engine
#   process at 256 (py-spy's wheel carried in .whl).
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
             f", ITL p99 / TPOT p50 {r['itl_p99_over_tpot_p50']:.2f}, offline ITL p99 {r['offline_itl_ms']['p99']:.2f} ms"
             if "fraction_of_offline" in r else "")
          + f", TPOT p50 {r['tpot_ms']['p50']:.2f} ms, ITL p99 {r['itl_ms']['p99']:.2f} ms"
          + f", tokens/chunk {r.get('output_tokens_per_chunk', 0):.3f}, errors {r['errors']}")
EOF
}

profile() {  # the server (engine process) under 256 streams, sampled by py-spy (carried in .whl)
  local port=8199 spy=/tmp/site/bin/py-spy pid engine
  python3 -m pagedllm serve /tmp/llama3-8b --port $port $ARGS > "$OUT/$NAME-server-profile.log" 2>&1 &
  pid=$!
  for _ in $(seq 180); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
    sleep 1
  done
  engine=$(grep -o 'engine core process [0-9]*' "$OUT/$NAME-server-profile.log" | awk '{print $4}')
  echo "server $pid engine $engine" | tee -a "$OUT/summary.log"
  timeout 200 python3 bench/serve.py --base-url http://127.0.0.1:$port --server-pid $pid --input-len 256 \
    --output-len 256 --client-processes 4 --concurrency 64 256 --num-prompts 256 1024 --label pagedllm-profile \
    --out "$OUT/$NAME-serve-profile.json" > "$OUT/$NAME-profile.log" 2>&1 &
  local load=$!
  sleep 25  # the c=64 level, then into c=256
  PYTHONPATH= timeout 30 $spy record -p $pid -d 8 -r 200 --nonblocking --threads -f raw -o "$OUT/$NAME-spy-frontend.txt" \
    > "$OUT/$NAME-spy-frontend.log" 2>&1 &
  PYTHONPATH= timeout 30 $spy record -p $engine -d 8 -r 200 --nonblocking --threads -f raw -o "$OUT/$NAME-spy-engine.txt" \
    > "$OUT/$NAME-spy-engine.log" 2>&1
  wait $load
  kill $pid; wait $pid
  echo "profile: $(grep 'out tok/s' "$OUT/$NAME-profile.log" | tr '\n' ' ')" | tee -a "$OUT/summary.log"
  python3 -c "
import json, sys
for r in json.load(open('$OUT/$NAME-serve-profile.json'))['runs']:
    print('  c=%d cpu %s' % (r['concurrency'], {k: round(v, 2) for k, v in r.get('server_cpu_utilization', {}).items()}))
" | tee -a "$OUT/summary.log"
}

case ${STAGE:-all} in
  all) run mp --offline; PAGEDLLM_ENABLE_MULTIPROCESSING=0 run thread ;;
  mp) run mp --offline ;;
  asc)  # several API server processes (--api-server-count)
    base=$ARGS
    ARGS="$base --api-server-count 2" run asc2 --offline
    ARGS="$base --api-server-count 4" run asc4 ;;
  asc4) ARGS="$ARGS --api-server-count 4" run asc4 --offline ;;
  profile) profile ;;
esac
