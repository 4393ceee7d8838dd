"""--quantization on the command line (issue #23): `pagedllm generate` / `chat` accept exactly the
names pagedllm.model_executor.quantization knows (the online methods of QUANTIZATION_METHODS and
the checkpoint formats of CHECKPOINT_METHODS) and hand the choice to LLM; an unknown name is
argparse's error; `pagedllm serve`'s parser passes it to EngineArgs; and `python -m pagedllm
generate --quantization gguf` on the bundled model prints the text the dequantized model prints."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagedllm.cli import build_parser, make_llm
from pagedllm.model_executor.quantization import CHECKPOINT_METHODS, QUANTIZATION_METHODS

NAMES = sorted(set(QUANTIZATION_METHODS) | set(CHECKPOINT_METHODS))


def _quantization_choices(parser: argparse.ArgumentParser, command: str) -> set:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return set(next(a for a in sub._actions if a.dest == "quantization").choices)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_quantization_choices_are_the_known_methods(command):
    assert _quantization_choices(build_parser(), command) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_accepts_each_method_and_hands_it_to_llm(command, name, monkeypatch):
    import pagedllm

    argv = [command, "--quantization", name] + (["a prompt"] if command == "generate" else [])
    args = build_parser().parse_args(argv)
    assert args.quantization == name
    assert build_parser().parse_args(argv[:1] + (["a prompt"] if command == "generate" else [])).quantization is None

    seen = {}

    class FakeLLM:
        def __init__(self, model=None, **kwargs):
            seen.update(kwargs, model=model)

    monkeypatch.setattr(pagedllm, "LLM", FakeLLM)
    make_llm(args)
    assert seen["quantization"] == name and seen["model"] is None


@pytest.mark.parametrize("bad", ["bitsandbytes", "GGUF", "int2", ""])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_rejects_an_unknown_method_naming_it(command, bad, capsys):
    from pagedllm.cli import main

    argv = [command, "--quantization", bad] + (["a prompt"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exc:
        main(argv)  # parsed before any model is loaded
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --quantization: invalid choice: {bad!r}" in err, err
    for name in NAMES:  # argparse lists the choices (quoted or not, by Python version)
        assert name in err.split("invalid choice")[1], (name, err)


@pytest.mark.parametrize("name", ["gguf", None])
def test_server_parser_passes_quantization_to_engine_args(name):
    from pagedllm.engine.llm_engine import EngineArgs
    from pagedllm.entrypoints.openai.api_server import add_server_args
    from pagedllm.entrypoints.openai.cli_args import add_engine_args, engine_args_from

    argv = ["--quantization", name] if name else []
    server = argparse.ArgumentParser(prog="pagedllm serve")
    add_server_args(server)  # the parser `pagedllm serve` builds
    engine_only = argparse.ArgumentParser()
    add_engine_args(engine_only)
    for parser in (server, engine_only):
        engine_args = engine_args_from(parser.parse_args(argv))
        assert isinstance(engine_args, EngineArgs)
        assert engine_args.quantization == name
    assert engine_args_from(server.parse_args(["--quantization", "gguf", "--dtype", "float32"])).dtype == "float32"


def _generate(*extra: str) -> str:
    cmd = [sys.executable, "-m", "pagedllm", "generate", *extra, "--dtype", "float32", "--max-tokens", "8",
           "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512", "The capital of France is"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, (cmd, proc.stdout, proc.stderr[-4000:])
    return proc.stdout


@pytest.mark.slow
def test_generate_with_gguf_quantization_prints_the_dequantized_models_text():
    """float32: the gguf path is within 5e-5 in logprob of the dequantized model
    (test_gguf_quantization.py), so the greedy text is the same. Two subprocesses: 12-22 s on the
    2-core VM."""
    quantized = _generate("--quantization", "gguf")
    plain = _generate()
    print(f"generate --quantization gguf: {quantized!r}; without: {plain!r}")
    assert quantized.strip() and quantized == plain
