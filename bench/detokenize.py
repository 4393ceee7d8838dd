"""Host cost of detokenization per decode step: B sequences of the bundled tokenizer (SmolLM2),
one random token each per step for T steps, finished at the last; incremental (two decodes per
token, as streaming and stop strings need) against defer_text (LLM.generate's FINAL_ONLY requests
without stop strings: decode once at the finish). Alternating repeats; the median per step.

    PYTHONPATH=python python3 bench/detokenize.py [--batch 256] [--steps 128] [--repeats 3] [--out DIR]
Prints one JSON document (and writes DIR/<date>-<machine>-detokenize.json with --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))  # the bundled tokenizer helper

from _tokenizers import smollm2_tokenizer  # noqa: E402
from pagedllm.benchmarks.throughput import git_commit  # noqa: E402
from pagedllm.detokenizer import IncrementalDetokenizer  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


def per_step_ms(tok, streams, defer: bool) -> float:
    ds = [IncrementalDetokenizer(tok, SamplingParams(), defer_text=defer) for _ in streams]
    steps = len(streams[0])
    t = time.perf_counter()
    for step in range(steps):
        last = step == steps - 1
        for d, s in zip(ds, streams):
            d.update([s[step]], False, finished=last)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--machine", default="vm")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    tok = smollm2_tokenizer()
    rng = random.Random(0)
    streams = [[rng.randrange(len(tok)) for _ in range(args.steps)] for _ in range(args.batch)]
    times = {"incremental": [], "deferred": []}
    for _ in range(args.repeats):
        times["incremental"].append(per_step_ms(tok, streams, False))
        times["deferred"].append(per_step_ms(tok, streams, True))
    doc = {
        "bench": "detokenize", "date": datetime.date.today().isoformat(), "commit": git_commit(Path(ROOT)),
        "machine": args.machine, "python": platform.python_version(), "load_avg": os.getloadavg()[0],
        "batch": args.batch, "steps": args.steps,
        "ms_per_step": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "median_ms_per_step": {k: round(statistics.median(v), 3) for k, v in times.items()},
    }
    doc["saved_ms_per_step"] = round(doc["median_ms_per_step"]["incremental"] - doc["median_ms_per_step"]["deferred"], 3)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{doc['date']}-{args.machine}-detokenize.json"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
