#!/usr/bin/env bash
# Development build without pip: builds libpagedllm, the tests and pagedllm._C into
# build/dev and copies _C into python/pagedllm, so `PYTHONPATH=python python -m pytest` works
# against this tree. Uses the current python3 (it needs pybind11, numpy, torch installed).
#   bash scripts/dev_build.sh [extra cmake args]   then   ctest --test-dir build/dev
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${PAGEDLLM_DEV_BUILD:-build/dev}"
cmake -S . -B "$BUILD" -G Ninja -DPAGEDLLM_BUILD_TESTS=ON -DPAGEDLLM_PYTHON=ON -DPAGEDLLM_INPLACE=ON \
  -DPAGEDLLM_CUDA="${PAGEDLLM_CUDA:-OFF}" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
  -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
