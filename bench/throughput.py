"""Offline throughput: pagedllm LLM.generate vs Hugging Face transformers generate (one static
batch) vs vLLM's CPU build (when a Python with vllm is given), on the same workload, in one run.

Workload (../shared/peers.md): N prompts of P random token ids in, O tokens out, ignore_eos,
the same dtype, T threads. Prints JSON and writes bench/results/<date>-<machine>-throughput.json
(with the git commit). Output tokens/s, the ratios, and start-up seconds (LLM() construction and
construction + first token).

    python3 bench/throughput.py [--num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16
                                 --threads 2 --skip-hf --vllm-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROCESS_START = time.perf_counter()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


def bench_pagedllm(args, prompts) -> dict:
    from pagedllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes, max_model_len=args.max_model_len)
    construct = time.perf_counter() - t0
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds,
            "requests_s": len(prompts) / seconds, "startup_construct_s": construct,
            "startup_to_first_token_s": first_token,
            "process_start_to_first_token_s": t0 - PROCESS_START + first_token}


def bench_hf(args, prompts, folder) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "auto": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    startup = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False, pad_token_id=0,
                             temperature=None, top_p=None, top_k=None)
    seconds = time.perf_counter() - t1
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds, "startup_s": startup}


VLLM_SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    folder, dtype, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.load(sys.stdin)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(folder, dtype=dtype, max_model_len=2048)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=1), use_tqdm=False)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"output_tokens": n, "seconds": seconds, "output_tok_s": n / seconds,
                                  "startup_to_first_token_s": startup}))
"""


def bench_vllm(args, prompts, folder) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    proc = subprocess.run([args.vllm_python, "-c", VLLM_SCRIPT, str(folder), args.dtype, str(args.output_len)],
                          input=json.dumps(prompts), capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr or proc.stdout)[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu installed (peers.md)")
    parser.add_argument("--name", default="throughput")
    args = parser.parse_args()

    import torch

    from pagedllm import ops
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import resolve_model

    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    result = {
        "bench": "throughput", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_threads": args.threads, "commit": _git_commit(),
        "workload": {"model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct (bundled GGUF)",
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "dtype": args.dtype, "ignore_eos": True},
    }
    result["pagedllm"] = bench_pagedllm(args, prompts)
    if not args.skip_hf:
        result["hf_transformers"] = bench_hf(args, prompts, folder)
        result["ratio_vs_hf"] = result["pagedllm"]["output_tok_s"] / result["hf_transformers"]["output_tok_s"]
    if args.vllm_python:
        result["vllm_cpu"] = bench_vllm(args, prompts, folder)
        if "output_tok_s" in result["vllm_cpu"]:
            result["ratio_vs_vllm"] = result["pagedllm"]["output_tok_s"] / result["vllm_cpu"]["output_tok_s"]
    text = json.dumps(result, indent=2)
    print(text)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    (out_dir / f"{day}-{platform.node() or 'machine'}-{args.name}.json").write_text(text + "\n")
    return 0


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
