"""`pagedllm serve` flags: every engine argument of LLM / EngineArgs has a flag, parsed into the
EngineArgs the server builds its AsyncLLM from; server defaults (loopback host)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.engine.llm_engine import EngineArgs
from pagedllm.entrypoints.openai.api_server import add_server_args
from pagedllm.entrypoints.openai.cli_args import engine_args_from, parse_bytes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedllm serve")
    add_server_args(p)
    return p


def test_every_engine_argument_has_a_flag():
    text = parser().format_help()
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in text, f.name


def test_flags_parse_into_engine_args_and_defaults_match():
    args = parser().parse_args([])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None
    assert engine_args_from(args) == EngineArgs()
    args = parser().parse_args([
        "some/model", "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "2GiB",
        "--max-model-len", "1024", "--dtype", "bfloat16", "--scheduling-policy", "priority", "--seed", "7",
        "--max-num-batched-tokens", "64", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k",
        "--served-model-name", "a", "b", "--max-queued-requests", "3",
    ])
    ea = engine_args_from(args)
    assert args.model_tag == "some/model"
    assert (ea.block_size, ea.enable_prefix_caching, ea.kv_cache_memory_bytes) == (32, False, 2 << 30)
    assert (ea.max_model_len, ea.dtype, ea.scheduling_policy, ea.seed, ea.max_num_batched_tokens) == (
        1024, "bfloat16", "priority", 7, 64)
    assert (args.host, args.port, args.api_key, args.served_model_name, args.max_queued_requests) == (
        "0.0.0.0", 9001, ["k"], ["a", "b"], 3)


@pytest.mark.parametrize("text,value", [("1000", 1000), ("4GiB", 4 << 30), ("512M", 512_000_000), ("64MiB", 64 << 20),
                                        ("1.5k", 1500), ("2gb", 2_000_000_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_bad_flag_values_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--kv-cache-memory-bytes", "lots"])
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["--block-size", "x"])
    assert "--block-size" in capsys.readouterr().err


def test_serve_without_the_server_packages_is_a_one_line_message(monkeypatch, capsys):
    """`pagedllm serve` where the [serve] extra is missing: exit status 2 and one line naming the pip
    command, no traceback."""
    import importlib.util

    from pagedllm import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("fastapi", "uvicorn")
                        else real(name, *a))
    assert cli.main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'pagedllm[serve]'" in err and "fastapi" in err and "uvicorn" in err
