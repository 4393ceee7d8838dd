"""Offline throughput benchmark: pagedllm vs HF transformers (static batch) vs vLLM CPU.

A thin wrapper around pagedllm.benchmarks.throughput (also `pagedllm bench throughput`); see
that module for the workload, the options and the JSON written to bench/results/.

    python3 bench/throughput.py [--num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16
                                 --threads 2 --skip-hf --vllm-python /path/to/venv/bin/python
                                 --quantization none int8 int4 gguf
                                 --llama-cpp --llama-cpp-python /path/to/venv/bin/python]
"""

import sys
from pathlib import Path

try:  # the installed package, or PYTHONPATH=python after scripts/dev_build.sh
    from pagedllm.benchmarks.throughput import main
except ImportError:  # a source checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from pagedllm.benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main())
