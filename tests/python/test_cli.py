"""The `pagedllm` CLI: generate and chat give what the offline API gives for the same greedy
request; bad options fail with exit code 2 naming the option, before any model is loaded."""

import io

from bundled_llm import bundled_llm, greedy

from pagedllm.cli import main

ENGINE = ["--threads", "1", "--dtype", "float32", "--kv-cache-memory-bytes", str(128 << 20), "--max-model-len", "2048"]


def test_generate_matches_llm_chat():
    out = io.StringIO()
    rc = main(["generate", "What is the capital of France?", "--max-tokens", "16", "--temperature", "0", *ENGINE],
              out=out)
    assert rc == 0
    want = bundled_llm().chat([{"role": "user", "content": "What is the capital of France?"}], greedy(16),
                              use_tqdm=False)[0].outputs[0].text
    assert out.getvalue() == want + "\n"
    assert "Paris" in out.getvalue()


def test_chat_streams_replies_with_history_and_reset():
    stdin = io.StringIO("What is 2+2?\nAnd times 3?\n/reset\nWhat is 2+2?\n/exit\nnever read\n")
    out = io.StringIO()
    assert main(["chat", "--max-tokens", "20", "--temperature", "0", *ENGINE], stdin=stdin, out=out) == 0
    lines = out.getvalue().split("\n")
    llm = bundled_llm()
    first = llm.chat([{"role": "user", "content": "What is 2+2?"}], greedy(20), use_tqdm=False)[0].outputs[0].text
    second = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": first},
         {"role": "user", "content": "And times 3?"}], greedy(20), use_tqdm=False,
    )[0].outputs[0].text
    text = out.getvalue()
    assert text.startswith(first + "\n" + second + "\n(conversation cleared)\n" + first + "\n"), lines


def test_bad_options_fail_fast(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "hi", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_version_and_cmake_dir(capsys):
    out = io.StringIO()
    assert main(["--version"], out=out) == 0
    import pagedllm

    assert out.getvalue().strip() == pagedllm.__version__
    rc = main(["--cmake-dir"], out=io.StringIO())
    assert rc in (0, 1)
    if rc == 1:  # an in-place build has no CMake package: the message says how to get one
        assert "pip install" in capsys.readouterr().err


def test_help_lists_every_subcommand_and_bench_defaults(capsys):
    """`pagedllm --help` names serve too (main hands it to the server before parsing); `pagedllm
    bench --help` prints the bench usage (exit 0); the throughput options show their defaults."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    for name in ("generate", "chat", "bench", "serve"):
        assert name in top.split("positional arguments:")[1], (name, top)
    assert main(["bench", "--help"]) == 0
    usage = capsys.readouterr().out
    for name in ("throughput", "latency", "kernels", "serve"):
        assert name in usage, (name, usage)
    assert main(["bench", "nope"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "(default 64)" in text and "(default bfloat16)" in text and "--skip-hf" in text
