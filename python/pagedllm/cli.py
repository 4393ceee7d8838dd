"""The `pagedllm` command line.

`pagedllm serve [MODEL] [--host ...] [--port ...] [engine flags]` starts the OpenAI-compatible
server (see pagedllm.entrypoints.openai.api_server; `pagedllm serve --help` lists every flag).
`pagedllm --cmake-dir` prints the folder that holds the installed CMake package config, for a
native server's `find_package(pagedllm)` (pass it as `-Dpagedllm_DIR=...`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmake_dir() -> Path:
    """Folder of `pagedllmConfig.cmake` inside the installed package (raises FileNotFoundError)."""
    root = Path(__file__).resolve().parent
    path = root / "lib" / "cmake" / "pagedllm"
    if not (path / "pagedllmConfig.cmake").is_file():
        raise FileNotFoundError(
            f"no pagedllmConfig.cmake under {path}: install pagedllm with `pip install .` "
            "(an in-place development build has no CMake package)"
        )
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.splitlines()[0],
                                     epilog="subcommands: serve (OpenAI-compatible server; pagedllm serve --help)")
    parser.add_argument("--cmake-dir", action="store_true", help="print the CMake package config folder and exit")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


_SUBCOMMANDS = {"serve": "pagedllm.entrypoints.openai.api_server"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _SUBCOMMANDS:
        import importlib

        return importlib.import_module(_SUBCOMMANDS[argv[0]]).main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmake_dir:
        try:
            print(cmake_dir())
        except FileNotFoundError as exc:
            print(f"pagedllm: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.version:
        import pagedllm

        print(pagedllm.__version__)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
