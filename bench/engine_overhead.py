"""Host overhead of one engine step, measured from Python with the simulated model.

Per step we time  schedule() + taking every numpy view the model runner needs
+ update_from_output() + release()  (the simulated model itself runs outside the timed part),
and report the median and p99 over many steps for:
  - decode-N: N running decode sequences (N = 64, 256, 1024), nothing else;
  - mixed-256: 256 running decodes plus a stream of 1,500-token prompts chunked under a
    2,048-token budget (every step mixes decodes with a chunked prefill).
Goal on a 2-core machine (issue 3): median <= 100 us at 256 and <= 400 us at 1,024.
The simulated model runs between the timed parts; its "full" mode (the tests' model: every
sampled row reads its whole context back) sweeps megabytes and leaves the CPU caches cold for the
engine, as a heavy host-side model would; "last" reads only each row's last token. Both are
reported; the machine's load average is recorded too (the 2 cores are shared).

Prints one JSON document and writes it to <out>/<YYYY-MM-DD>-<machine>-engine_overhead.json with
the git commit.
    PYTHONPATH=python python3 bench/engine_overhead.py [--steps 300] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))  # the simulated model

from engine_sim import SimModel  # noqa: E402
from pagedllm import _C  # noqa: E402

VOCAB = 32000
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def timed_step(core, model, clock=time.perf_counter_ns):
    """One step; returns (host ns, SchedulerOutput counts)."""
    t0 = clock()
    out = core.schedule()
    views = (out.input_ids, out.positions, out.slot_mapping, out.block_tables, out.seq_lens,
             out.query_start_loc, out.logits_indices, out.sample_seq_ids, out.copy_orders,
             out.new_seqs, out.prompt_logprob_rows)
    t1 = clock()
    sampled = model.step(out)
    info = (out.num_tokens, out.num_seqs, out.num_decode_seqs)
    del views
    t2 = clock()
    result = core.update_from_output(out, sampled)
    _ = (result.seq_ids, result.token_ids, result.finished, result.request_finished)
    core.release(out)
    t3 = clock()
    return (t1 - t0) + (t3 - t2), info


def make_core(num_seqs: int, budget: int, num_blocks: int):
    cfg = _C.EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=num_seqs,
                          max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN)
    return _C.EngineCore(cfg)


def decode_params(max_tokens: int):
    return _C.RequestParams(max_tokens=max_tokens, ignore_eos=True)


def bench_decode(n: int, steps: int, warmup: int, rng, sim: str) -> dict:
    prompt_len = 128
    core = make_core(n, 8192, n * ((prompt_len + steps + warmup + 64) // BLOCK_SIZE + 2))
    model = SimModel(core.stats().num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, VOCAB, context=sim)
    for i in range(n):
        core.add_request(f"d{i}", rng.integers(0, VOCAB, size=prompt_len, dtype=np.int32),
                         decode_params(steps + warmup + 32))
    while True:  # prefill everything
        _, (t, s, d) = timed_step(core, model)
        if d == n:
            break
    times, tokens = [], []
    for k in range(warmup + steps):
        ns, (t, s, d) = timed_step(core, model)
        assert d == n and t == n, (t, s, d)
        if k >= warmup:
            times.append(ns)
    return summarize(f"decode-{n}", n, times, n, sim)


def bench_mixed(n: int, steps: int, warmup: int, rng, sim: str) -> dict:
    prompt_len, long_prompt, budget = 128, 1500, 2048
    core = make_core(n + 8, budget, n * ((prompt_len + steps + warmup + 64) // BLOCK_SIZE + 2) + 2000)
    model = SimModel(core.stats().num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, VOCAB, context=sim)
    for i in range(n):
        core.add_request(f"d{i}", rng.integers(0, VOCAB, size=prompt_len, dtype=np.int32),
                         decode_params(steps + warmup + 64))
    while timed_step(core, model)[1][2] < n:  # until all n are decoding
        pass
    times, toks = [], []
    j = 0
    for k in range(warmup + steps):
        if core.stats().num_waiting < 2:  # keep a chunked prompt in line
            core.add_request(f"p{j}", rng.integers(0, VOCAB, size=long_prompt, dtype=np.int32),
                             decode_params(1))
            j += 1
        ns, (t, s, d) = timed_step(core, model)
        assert d >= n and t > d, (t, s, d)
        if k >= warmup:
            times.append(ns)
            toks.append(t)
    r = summarize(f"mixed-{n}", n, times, int(np.mean(toks)), sim)
    r["chunked_prefills"] = core.stats().num_chunked_prefills
    return r


def summarize(name, n, times_ns, tokens_per_step, sim) -> dict:
    us = np.asarray(times_ns, dtype=np.float64) / 1e3
    return {
        "scenario": name,
        "sim_context": sim,
        "running_decodes": n,
        "tokens_per_step": tokens_per_step,
        "steps": len(us),
        "median_us": round(float(np.median(us)), 2),
        "p99_us": round(float(np.percentile(us, 99)), 2),
        "mean_us": round(float(us.mean()), 2),
        "min_us": round(float(us.min()), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--machine", default=socket.gethostname())
    ap.add_argument("--sim", nargs="+", default=["full", "last"], choices=["full", "last"],
                    help="simulated model: read each sampled row's whole context back, or its last token")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for sim in args.sim:
        results += [bench_decode(n, args.steps, args.warmup, rng, sim) for n in (64, 256, 1024)]
        results.append(bench_mixed(256, args.steps, args.warmup, rng, sim))
    by = {(r["scenario"], r["sim_context"]): r for r in results}
    doc = {
        "benchmark": "engine_overhead",
        "what": "schedule() + numpy views + update_from_output() + release(), per step, from Python",
        "date": datetime.date.today().isoformat(),
        "machine": args.machine,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "block_size": BLOCK_SIZE,
        "results": results,
        "load_average_1m": os.getloadavg()[0],
        "goal": {
            f"decode-256 median_us <= 100 (sim {sim})": by[("decode-256", sim)]["median_us"] <= 100
            for sim in args.sim
        } | {
            f"decode-1024 median_us <= 400 (sim {sim})": by[("decode-1024", sim)]["median_us"] <= 400
            for sim in args.sim
        },
    }
    text = json.dumps(doc, indent=2)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{doc['date']}-{args.machine}-engine_overhead.json")
    with open(path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
