"""Serving benchmark (load generator for any OpenAI-compatible server): a thin wrapper around
pagedllm.benchmarks.serve (also `pagedllm bench serve`); see that module for the options."""

import sys
from pathlib import Path

try:  # the installed package, or PYTHONPATH=python
    from pagedllm.benchmarks.serve import main
except ImportError:  # a source checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from pagedllm.benchmarks.serve import main

if __name__ == "__main__":
    sys.exit(main())
