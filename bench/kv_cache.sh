#!/usr/bin/env bash
# Build and run bench/kv_cache_bench.cpp (Release, this machine's instruction set); the JSON goes
# to stdout and to bench/results/<YYYY-MM-DD>-<hostname>-kv_cache.json with the git commit.
#   bash bench/kv_cache.sh [--quick]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${PAGEDLLM_BENCH_BUILD:-build/bench}"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDLLM_BUILD_TESTS=ON \
  -DPAGEDLLM_PYTHON=OFF -DPAGEDLLM_CUDA=OFF >/dev/null
cmake --build "$BUILD" -j2 --target kv_cache_bench >/dev/null
COMMIT="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if ! git diff --quiet HEAD -- cpp bench 2>/dev/null; then COMMIT="$COMMIT-dirty"; fi
MACHINE="$(hostname)"
mkdir -p bench/results
OUT="bench/results/$(date -u +%F)-${MACHINE}-kv_cache.json"
"$BUILD/kv_cache_bench" --out "$OUT" --commit "$COMMIT" --machine "$MACHINE" "$@"
echo "wrote $OUT" >&2
