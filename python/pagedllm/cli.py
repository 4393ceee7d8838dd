"""The `pagedllm` command line.

    pagedllm generate "What is the capital of France?" [more prompts...] [options]
    pagedllm chat [--system "You are terse."] [options]       (interactive; /reset, /exit)
    pagedllm bench throughput [--num-prompts 64 --input-len 128 --output-len 128 ...]
    pagedllm bench latency [--batch-size 8 --input-len 32 --output-len 128 ...]
    pagedllm bench serve [--base-url URL | --start-server ARGS] [--concurrency 1 8 32 ...]
    pagedllm bench kernels [--op paged_decode rms_norm ... --device cpu|cuda --json OUT --plot OUT.png]
    pagedllm serve [MODEL] [--host 127.0.0.1 --port 8000 --api-key KEY ...]  (OpenAI-compatible server)
    pagedllm --cmake-dir        the installed CMake package folder (for find_package(pagedllm))
    pagedllm --version

`generate` and `chat` run the bundled SmolLM2-135M-Instruct unless --model names another model
(a Hugging Face folder, a .gguf file or a hub id in the local cache). `generate` wraps each
prompt in the tokenizer's chat template when it has one (--raw: complete the text as is).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, Optional, TextIO


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


# ---------------------------------------------------------------------------------- options
def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="model folder, .gguf file or cached hub id (default: bundled SmolLM2)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool size in bytes")
    g.add_argument("--threads", type=int, default=0, help="CPU threads for torch and the kernels (0: leave as is)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks of this host (CUDA: GPUs; CPU: processes)")
    g.add_argument("--quantization", default=None,
                   choices=["int8", "int4", "gguf", "fp8", "gptq", "awq", "compressed-tensors"],
                   help="weight quantization (docs/quantization.md): int8 (CPU), int4 (CPU, CUDA), gguf (the GGUF "
                        "file's own types, CPU), fp8 (CUDA); gptq, awq, compressed-tensors: the checkpoint's own "
                        "(read from its config.json without this flag)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the KV cache's dtype (docs/fp8_kv_cache.md): fp8 holds twice the tokens of bfloat16")


def _sampling_options(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    g = p.add_argument_group("sampling (vLLM's SamplingParams)")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed (SamplingParams.seed)")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:8]),
    )
    parser.add_argument("--cmake-dir", action="store_true", help="print the CMake package config folder and exit")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{generate,chat,bench,serve}")

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--raw", action="store_true", help="complete the prompt text as is (no chat template)")
    gen.add_argument("--system", default=None, help="a system message (chat template only)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    _engine_options(gen)
    _sampling_options(gen, max_tokens=128, temperature=0.0)

    chat = sub.add_parser("chat", help="chat interactively (/reset clears the history, /exit quits)")
    chat.add_argument("--system", default=None, help="a system message")
    _engine_options(chat)
    _sampling_options(chat, max_tokens=512, temperature=0.7)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="{throughput,latency,kernels,serve}")
    bench_sub.add_parser(
        "throughput", help="offline throughput vs HF transformers (and vLLM CPU)", add_help=False,
    )
    bench_sub.add_parser("latency", help="one batch: latency, prefill and per-token decode", add_help=False)
    bench_sub.add_parser("serve", help="load generator for an OpenAI-compatible server: TTFT, TPOT, ITL, "
                                       "throughput", add_help=False)
    bench_sub.add_parser("kernels", help="kernels against their float64 reference and peers: time, "
                                         "bandwidth, roofline", add_help=False)
    # main() hands `serve` to the server before this parser runs; listed here for --help only.
    sub.add_parser("serve", help="the OpenAI-compatible server (pagedllm serve --help)", add_help=False)
    return parser


def sampling_params_from(args: argparse.Namespace, **extra):
    """SamplingParams from the parsed options (ValueError naming the field for bad values)."""
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.sample_seed,
        stop=args.stop, ignore_eos=args.ignore_eos, **extra,
    )


def make_llm(args: argparse.Namespace):
    """The LLM for the engine options (threads pinned first when --threads is given)."""
    if args.threads > 0:
        from pagedllm import ops

        ops.set_cpu_threads(args.threads)
    from pagedllm import LLM

    return LLM(
        args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, with the generation
    prompt; the template's own BOS is kept and no second one is added (vLLM PR #16976)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# ---------------------------------------------------------------------------------- commands
def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    params = sampling_params_from(args, n=args.n)
    llm = make_llm(args)
    try:
        tok = llm.get_tokenizer()
        if args.raw or not has_chat_template(tok):
            prompts = list(args.prompts)
        else:
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompts = [
                {"prompt_token_ids": chat_prompt_ids(tok, system + [{"role": "user", "content": p}]), "prompt": p}
                for p in args.prompts
            ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, result in zip(args.prompts, outputs):
            if len(args.prompts) > 1 or args.n > 1:
                print(f"### {prompt}", file=out)
            for comp in result.outputs:
                if args.n > 1:
                    print(f"--- [{comp.index}]", file=out)
                print(comp.text, file=out)
        return 0
    finally:
        llm.shutdown()


def stream_reply(llm, prompt_token_ids: list[int], params) -> Iterator[str]:
    """Generate one reply and yield its text as it grows (DELTA outputs: the pieces join to the
    final text; partial stop strings and incomplete UTF-8 characters are held back)."""
    from pagedllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    request_id = engine.new_request_id()
    engine.add_request(request_id, None, prompt_token_ids, params)
    try:
        while True:
            outputs = engine.step()
            for o in outputs:
                if o.request_id != request_id:
                    continue
                for comp in o.outputs:
                    if comp.text:
                        yield comp.text
                if o.finished:
                    return
            if not outputs and not engine.has_unfinished_requests():
                return
    finally:
        if engine.has_request(request_id):
            engine.abort_request(request_id)


def cmd_chat(args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    params = sampling_params_from(args)
    llm = make_llm(args)
    try:
        tok = llm.get_tokenizer()
        if not has_chat_template(tok):
            print("pagedllm chat: this model's tokenizer has no chat template", file=sys.stderr)
            return 1
        system = [{"role": "system", "content": args.system}] if args.system else []
        history: list[dict] = []
        interactive = stdin.isatty()
        if interactive:
            print("pagedllm chat — /reset clears the conversation, /exit (or Ctrl-D) quits", file=out)
        while True:
            if interactive:
                print("> ", end="", file=out, flush=True)
            line = stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                history.clear()
                print("(conversation cleared)", file=out)
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = chat_prompt_ids(tok, system + history)
            reply = ""
            for piece in stream_reply(llm, ids, params):
                reply += piece
                print(piece, end="", file=out, flush=True)
            print(file=out, flush=True)
            history.append({"role": "assistant", "content": reply})
        return 0
    finally:
        llm.shutdown()


#: `pagedllm bench NAME` -> the module of pagedllm.benchmarks whose main(argv) runs it
_BENCHMARKS = ("throughput", "latency", "kernels", "serve")


def cmd_bench(argv: list[str]) -> int:
    usage = f"usage: pagedllm bench {{{','.join(_BENCHMARKS)}}} [options]  (pagedllm bench NAME --help)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in _BENCHMARKS:
        print(usage, file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(f"pagedllm.benchmarks.{argv[0]}").main(argv[1:])


#: what `pagedllm serve` imports beyond the core (the [serve] extra), by import name -> pip name
_SERVER_PACKAGES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic",
                    "prometheus_client": "prometheus-client"}


def _missing_server_packages() -> list[str]:
    import importlib.util

    return [pip for mod, pip in _SERVER_PACKAGES.items() if importlib.util.find_spec(mod) is None]


def main(argv: Optional[list[str]] = None, stdin: Optional[TextIO] = None, out: Optional[TextIO] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])  # the benchmark parses its own options
    if argv[:1] == ["serve"]:  # the server parses its own options (every engine argument)
        missing = _missing_server_packages()
        if missing:
            print(f"pagedllm serve needs {', '.join(missing)}: pip install 'pagedllm[serve]' (or pip install "
                  f"{' '.join(missing)})", file=sys.stderr)
            return 2
        from pagedllm.entrypoints.openai.api_server import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmake_dir:
        try:
            print(cmake_dir(), file=out)
        except FileNotFoundError as exc:
            print(f"pagedllm: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.version:
        import pagedllm

        print(pagedllm.__version__, file=out)
        return 0
    try:
        if args.command == "generate":
            return cmd_generate(args, out)
        if args.command == "chat":
            return cmd_chat(args, stdin, out)
    except ValueError as exc:
        print(f"pagedllm {args.command}: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
