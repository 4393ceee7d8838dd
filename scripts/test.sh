#!/usr/bin/env bash
# Every test: the GoogleTest suites through ctest, then pytest (slow tests included).
# Without a CUDA GPU the tests marked `cuda` are deselected, and the script says how many.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

# GoogleTest has no PyPI package: Debian's libgtest-dev (root or sudo; only the tests need it).
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  log "installing libgtest-dev (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null
fi

log "building the C++ tests (build/tests)"
cmake -S . -B build/tests -G Ninja -DPAGEDLLM_BUILD_TESTS=ON -DPAGEDLLM_CUDA=OFF -DPAGEDLLM_PYTHON=OFF >/dev/null
cmake --build build/tests -j"$(nproc)"

log "ctest"
ctest --test-dir build/tests --output-on-failure -j"$(nproc)"

log "pytest"
# Run from a neutral folder so `import pagedllm` finds the installed package, not python/.
cd "$ROOT/tests"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "$ROOT/tests/python" "$@"
else
  n_cuda=$("$PY" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "$ROOT/tests/python" -m cuda --collect-only -q 2>/dev/null | grep -c '::' || true)
  echo "no CUDA GPU here: deselecting $n_cuda test(s) marked cuda"
  "$PY" -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" "$ROOT/tests/python" -m "not cuda" "$@"
fi
