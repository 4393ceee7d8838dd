"""`python -m pagedllm`: the CLI (see pagedllm.cli)."""

from pagedllm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
