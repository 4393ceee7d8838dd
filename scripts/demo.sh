#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, build pagedllm, run the demonstration.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
log "running the demo"
"$PY" -m pagedllm.demo "$@"
