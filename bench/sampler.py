"""Sampler step time: median / p90 milliseconds of one Sampler call for R rows of V logits,
per parameter mix (greedy, temperature, top-k/top-p, penalties, seeded, logprobs).

    PYTHONPATH=python python3 bench/sampler.py [--rows 64 256] [--vocab 49152] [--threads 2] [--device cpu]

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


def time_mix(mix: str, rows: int, vocab: int, device: str, steps: int) -> dict:
    sampler = Sampler(vocab, capacity=rows)
    prompt = list(range(100, 228))
    for i in range(rows):
        sampler.add_sequence(i, MIXES[mix](i), prompt, 0, [2])
    seq_ids = np.arange(rows, dtype=np.int64)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    times = []
    for step in range(steps + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sampler(logits, seq_ids)
        times.append(time.perf_counter() - t0)
        sampler.append_output_tokens(seq_ids, out.sampled_token_ids)
    t = np.array(times[3:]) * 1e3
    return {"median_ms": round(float(np.median(t)), 3), "p90_ms": round(float(np.percentile(t, 90)), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "bench": "sampler", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "threads": args.threads, "device": args.device, "vocab": args.vocab,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "loadavg_1m": round(os.getloadavg()[0], 2), "results": {},
    }
    for rows in args.rows:
        for mix in MIXES:
            result["results"][f"{mix}/R={rows}"] = time_mix(mix, rows, args.vocab, args.device, args.steps)
    text = json.dumps(result, indent=2)
    print(text)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{datetime.date.today().isoformat()}-{platform.node() or 'machine'}-sampler.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
