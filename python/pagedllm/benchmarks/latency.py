"""`pagedllm bench latency`: the latency of one batch, end to end and split into prefill and
per-token decode (vLLM's `benchmark_latency`, same option names).

    pagedllm bench latency [--model PATH] [--batch-size 8] [--input-len 32] [--output-len 128]
        [--num-iters-warmup 3] [--num-iters 10] [--dtype auto] [--device auto] [--load-format auto]
        [--tensor-parallel-size 1] [--pipeline-parallel-size 1] [--json OUT.json]

Each iteration generates --output-len tokens (ignore_eos, greedy) for --batch-size new random
prompts of --input-len tokens (no prefix-cache hits in practice) and records: latency (first step to last token), prefill (until every sequence has its first token)
and decode per token ((latency - prefill) / (output_len - 1)). Prints the percentiles (vLLM's 10,
25, 50, 75, 90, 99) and the medians as JSON with the commit, the machine and the settings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pagedllm.benchmarks.kernels import _commit

PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_once(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """One batch through `engine` (an LLMEngine): seconds of latency, prefill and decode per token."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, ids, params)
    started = set()
    prefill = None
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
        if prefill is None and len(started) == len(prompts):
            prefill = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    prefill = latency if prefill is None else prefill
    steps = max(1, params.max_tokens - 1)
    return {"latency_s": latency, "prefill_s": prefill, "decode_s_per_token": (latency - prefill) / steps}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagedllm bench latency", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder or .gguf (default: the bundled SmolLM2-135M)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result document here (also printed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            print(f"pagedllm bench latency: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2

    from tqdm import tqdm

    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
              max_model_len=args.max_model_len or args.input_len + args.output_len,
              max_num_seqs=max(args.batch_size, 1))
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    try:
        total = args.num_iters_warmup + args.num_iters
        for it in tqdm(range(total), desc="latency", disable=args.no_progress, file=sys.stderr):
            prompts = [rng.integers(10, vocab, args.input_len).tolist() for _ in range(args.batch_size)]
            result = run_once(engine, prompts, params, f"it{it}")
            if it >= args.num_iters_warmup:
                runs.append(result)
    finally:
        llm.shutdown()
    latencies = [r["latency_s"] for r in runs]
    doc = {
        "bench": "latency", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "commit": _commit(), "settings": vars(args),
        "avg_latency_s": statistics.fmean(latencies),
        "latency_percentiles_s": {str(q): float(np.percentile(latencies, q)) for q in PERCENTILES},
        "median_prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "median_decode_ms_per_token": statistics.median(r["decode_s_per_token"] for r in runs) * 1e3,
        "iterations": runs,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
