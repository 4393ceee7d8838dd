"""Sampler step time: median / p90 milliseconds of one Sampler call for R rows of V logits,
per parameter mix (greedy, temperature, top-k/top-p, penalties, seeded, logprobs, and json: every
row under pagedllm.benchmarks.throughput.BENCH_SCHEMA, greedy), and of the step's
append_output_tokens (append_ms: the matchers' advance for json). The json mix also reports the
token bitmask's fill alone by xgrammar's BatchGrammarMatcher at 1, 2, 4 and 8 threads
("fill_ms_by_threads"); it needs a tokenizer of V tokens (--tokenizer, default the bundled model's).

    PYTHONPATH=python python3 bench/sampler.py [--rows 64 256] [--vocab 49152] [--threads 2] [--device cpu]
                                               [--mixes greedy json] [--tokenizer DIR]

Prints JSON and writes bench/results/<YYYY-MM-DD>-<hostname>-sampler.json with the git commit.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from pagedllm.sample import Sampler
    from pagedllm.sampling_params import SamplingParams
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))
    from pagedllm.sample import Sampler
    from pagedllm.sampling_params import SamplingParams

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_k_top_p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "penalties": lambda i: SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2),
    "seeded": lambda i: SamplingParams(temperature=0.8, seed=i),
    "logprobs_5": lambda i: SamplingParams(temperature=0.8, logprobs=5),
    "mixed": lambda i: [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.95),
                        SamplingParams(temperature=1.0, seed=i), SamplingParams(top_k=20)][i % 4],
}


def json_params(i: int):
    from pagedllm.benchmarks.throughput import BENCH_SCHEMA
    from pagedllm.sampling_params import StructuredOutputsParams

    return SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMA,
                                                                                   disable_any_whitespace=True))


MIXES["json"] = json_params


def time_mix(mix: str, rows: int, vocab: int, device: str, steps: int, manager=None) -> dict:
    sampler = Sampler(vocab, capacity=rows)
    prompt = list(range(100, 228))
    for i in range(rows):
        params = MIXES[mix](i)
        matcher = manager.matcher(params.structured_outputs) if params.structured_outputs is not None else None
        sampler.add_sequence(i, params, prompt, 0, [2], matcher)
    seq_ids = np.arange(rows, dtype=np.int64)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    times, appends, fills = [], [], {t: [] for t in (1, 2, 4, 8)}
    for step in range(steps + 3):
        if mix == "json":  # the fill alone, at several thread counts (state unchanged)
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(rows, vocab)
            matchers = [sampler._matchers[s] for s in sampler._slots_for(seq_ids).tolist()]
            for threads, acc in fills.items():
                batch = xgr.BatchGrammarMatcher(max_threads=threads)
                t0 = time.perf_counter()
                batch.batch_fill_next_token_bitmask(matchers, bitmask)
                acc.append(time.perf_counter() - t0)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sampler(logits, seq_ids)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sampler.append_output_tokens(seq_ids, out.sampled_token_ids)
        appends.append(time.perf_counter() - t0)

    def ms(values, q=50):
        return round(float(np.percentile(np.array(values[3:]) * 1e3, q)), 3)

    out = {"median_ms": ms(times), "p90_ms": ms(times, 90), "append_ms": ms(appends)}
    if mix == "json":
        out["fill_ms_by_threads"] = {t: ms(v) for t, v in fills.items()}
        out["fill_p90_ms_by_threads"] = {t: ms(v, 90) for t, v in fills.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--tokenizer", default=None, help="json mix: a tokenizer folder of --vocab tokens "
                    "(default: the bundled SmolLM2's)")
    args = ap.parse_args()
    manager = None
    if "json" in args.mixes:
        from transformers import AutoTokenizer

        from pagedllm.model_executor.loader import resolve_model
        from pagedllm.structured_output import StructuredOutputManager

        manager = StructuredOutputManager(AutoTokenizer.from_pretrained(args.tokenizer or str(resolve_model(None))),
                                          args.vocab)
    torch.set_num_threads(args.threads)
    result = {
        "bench": "sampler", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "threads": args.threads, "device": args.device, "vocab": args.vocab,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "loadavg_1m": round(os.getloadavg()[0], 2), "results": {},
    }
    for rows in args.rows:
        for mix in args.mixes:
            result["results"][f"{mix}/R={rows}"] = time_mix(mix, rows, args.vocab, args.device, args.steps, manager)
    text = json.dumps(result, indent=2)
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today().isoformat()}-{platform.node() or 'machine'}-sampler.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
