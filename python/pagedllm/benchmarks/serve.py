"""`pagedllm bench serve` (also bench/serve.py): a load generator for any OpenAI-compatible
server (pagedllm, vLLM, ...).

Sends streamed /v1/completions requests with synthetic prompts (random token ids, so every
server sees the same prompts; lengths uniform in [len*(1-range), len*(1+range)]) and
ignore_eos + max_tokens, at a fixed concurrency or with Poisson arrivals at a rate, and reports
TTFT, TPOT, ITL (p50/p90/p99, mean; milliseconds), request and token throughput, and errors.

    pagedllm bench serve --base-url http://127.0.0.1:8000 --concurrency 1 8 32 --num-prompts 64
    python bench/serve.py --start-server "--dtype bfloat16" --concurrency 1 8 32   # starts pagedllm
    python bench/serve.py --base-url ... --request-rate 4 --num-prompts 64
    python bench/serve.py --start-server "--load-format dummy" --server-model DIR --offline \
        --concurrency 1 16 64 256 --num-prompts 32 256 512 1024 --client-processes 4

--offline first runs pagedllm's offline engine with the server's engine arguments on the same
prompts at each concurrency (c requests in flight, no HTTP), so each level reports the server's
fraction of it and ITL p99 / TPOT p50 (1.5 or less: one chunk per token). --client-processes
spreads the clients over processes so that the load generator is not what is measured.

Definitions (as vLLM's benchmark_serving): TTFT = time from sending the request to the first
streamed token; TPOT = (e2e - TTFT) / (output tokens - 1) per request; ITL = time between
consecutive streamed chunks; output tok/s = all output tokens / wall time of the run.
JSON goes to stdout and to bench/results/<YYYY-MM-DD>-<hostname>-serve[-label].json with the git
commit (in a source checkout; else to the current folder, or --out). Needs httpx (pip install httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import httpx
except ImportError:  # (a dependency of the [test] extra and of the openai client)
    httpx = None

#: the source checkout (bench/results there), when this runs from one
ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried text
    error: str = ""


def make_prompts(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, vocab_lo: int,
                 vocab_hi: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [([rng.randrange(vocab_lo, vocab_hi) for _ in range(length(input_len))], length(output_len))
            for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      headers: dict) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:200]
                    return res
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                if any(c.get("text") for c in msg.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - start
        res.chunks = chunks
        if res.output_tokens == 0:
            res.output_tokens = chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "no token streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0

    def stats(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values) * ms if values else float("nan"),
                "p50": pct(values, 50) * ms, "p90": pct(values, 90) * ms, "p99": pct(values, 99) * ms}

    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok), "errors": len(errors), "error_examples": errors[:3], "duration_s": wall,
        "request_throughput_rps": len(ok) / wall, "output_throughput_tok_s": out_tokens / wall,
        "total_token_throughput_tok_s": (in_tokens + out_tokens) / wall,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        # 1.0: one chunk per token (more: the server merged tokens into chunks, or held text back)
        "output_tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)),
        "ttft_ms": stats([r.ttft for r in ok]), "tpot_ms": stats(tpot),
        "itl_ms": stats([x for r in ok for x in r.itl]), "e2e_ms": stats([r.e2e for r in ok]),
    }


async def _load(base_url: str, model: str, prompts, concurrency: int | None, rate: float | None, seed: int,
                api_key: str | None, start_at: float | None = None) -> tuple[list[Result], float, float]:
    """(results, start, end) of one load: `concurrency` clients back to back, or Poisson arrivals;
    start_at: the perf_counter time to begin at (client processes start together)."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or 0, 256), max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        results: list[Result] = []
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        if concurrency is not None:
            queue = list(prompts)

            async def worker():
                while queue:
                    prompt, max_tokens = queue.pop(0)
                    results.append(await one_request(client, url, model, prompt, max_tokens, headers))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed + 1)
            tasks = []
            for prompt, max_tokens in prompts:
                tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, headers)))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        end = time.perf_counter()
    return results, start, end


def _load_in_process(job) -> tuple[list[Result], float, float]:
    """One client process's share of a load (--client-processes); perf_counter is the system's
    monotonic clock, shared by the processes of one machine."""
    return asyncio.run(_load(*job))


def run_load(base_url: str, model: str, prompts, concurrency: int | None, rate: float | None, seed: int,
             api_key: str | None, processes: int = 1) -> dict:
    """Summary of one load. processes > 1: the clients (and the prompts, round robin) split over that
    many processes, so that the load generator's own Python is not what is measured at high
    concurrency (a fixed concurrency only)."""
    if processes <= 1 or concurrency is None:
        results, start, end = asyncio.run(_load(base_url, model, prompts, concurrency, rate, seed, api_key))
        return summarize(results, end - start)
    import multiprocessing

    processes = min(processes, concurrency)
    start_at = time.perf_counter() + 5.0  # after every process has started and imported httpx
    jobs = [(base_url, model, prompts[i::processes], concurrency // processes + (i < concurrency % processes),
             None, seed, api_key, start_at) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.map(_load_in_process, jobs)
    results = [r for part in parts for r in part[0]]
    return summarize(results, max(p[2] for p in parts) - min(p[1] for p in parts))


def offline_levels(server_args: str, server_model: str | None, jobs: list[tuple[int, list]]) -> list[dict]:
    """pagedllm's offline engine (LLMEngine, no server) on the same prompts at each concurrency:
    `c` requests in flight, the next added as one finishes. The engine arguments are those
    `pagedllm serve` would build from server_args; runs in a spawned process (its GPU memory is
    free before the server starts). jobs: (concurrency, prompts). Returns per level the output
    tok/s, the wall time, the steps, output tokens per output, and the inter-token latency
    percentiles (ms, between a request's outputs that carry tokens)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_offline_levels, (server_args, server_model, jobs))


def _offline_levels(server_args: str, server_model: str | None, jobs) -> list[dict]:
    import argparse as _argparse

    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import add_server_args
    from pagedllm.entrypoints.openai.cli_args import engine_args_from
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    parser = _argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args([*([server_model] if server_model else []), *server_args.split()])
    if ns.threads > 0:  # as run_server: torch's and the CPU kernels' threads
        from pagedllm import ops

        ops.set_cpu_threads(ns.threads)
    engine_args = engine_args_from(ns)
    if ns.model_tag is not None:
        engine_args.model = ns.model_tag
    engine = LLMEngine(engine_args)
    out = []
    try:
        warmup = [(2, jobs[0][1][:4])] if jobs else []  # compiles / captures before the first level
        for concurrency, prompts in warmup + list(jobs):
            queue = list(prompts)
            ids = iter(range(1 << 62))
            tokens = steps = outputs = 0
            last: dict[str, float] = {}  # request -> time of its last tokens
            itl: list[float] = []
            start = time.perf_counter()

            def add():
                prompt, max_tokens = queue.pop(0)
                engine.add_request(f"o{next(ids)}", None, prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA))

            for _ in range(min(concurrency, len(queue))):
                add()
            while engine.has_unfinished_requests():
                step = engine.step()
                now = time.perf_counter()
                for o in step:
                    n = sum(len(c.token_ids) for c in o.outputs)
                    if n:
                        tokens += n
                        outputs += 1
                        if o.request_id in last:
                            itl.append(now - last[o.request_id])
                        last[o.request_id] = now
                    if o.finished:
                        last.pop(o.request_id, None)
                        if queue:
                            add()
                steps += 1
            wall = time.perf_counter() - start
            out.append({"concurrency": concurrency, "num_prompts": len(prompts), "output_throughput_tok_s": tokens / wall,
                        "duration_s": wall, "steps": steps, "output_tokens_per_output": tokens / max(1, outputs),
                        "itl_ms": {"p50": pct(itl, 50) * 1e3, "p90": pct(itl, 90) * 1e3, "p99": pct(itl, 99) * 1e3}})
    finally:
        engine.shutdown()
    return out[1:]


def process_cpu(pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) so far of a server process and of each of its child processes
    ("server", "engine" for pagedllm's engine-core process, else "child-<pid>"); {} off Linux."""
    if pid is None:
        return {}
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    try:
        out = {"server": cpu(pid)}
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
                name = ("engine" if b"spawn_main" in cmd and b"resource_tracker" not in cmd
                        else f"child-{child}")
                out[name] = cpu(int(child))
        return out
    except OSError:
        return {}


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _metric(text: str, name: str) -> float:
    """Sum of a /metrics series over its labels (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run_soak(base_url: str, model: str, prompts, concurrency: int, seconds: float, api_key: str | None,
                   pid: int | None, sample_s: float, warmup_s: float) -> dict:
    """`concurrency` clients sending streamed requests back to back (cycling through `prompts`) for
    `seconds`; the server's resident memory every `sample_s` seconds (when its pid is known); then,
    with the load gone, its KV-cache usage and running / waiting requests from /metrics."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    results: list[Result] = []
    rss: list[tuple[float, int]] = []
    start = time.perf_counter()
    deadline = start + seconds
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker(i: int):
            k = i
            while time.perf_counter() < deadline:
                prompt, max_tokens = prompts[k % len(prompts)]
                k += concurrency
                results.append(await one_request(client, url, model, prompt, max_tokens, headers))

        async def sampler():
            while time.perf_counter() < deadline:
                if pid is not None:
                    rss.append((round(time.perf_counter() - start, 1), _rss_bytes(pid)))
                await asyncio.sleep(sample_s)

        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
        await asyncio.sleep(2.0)  # the last requests' blocks are freed by the engine's next iteration
        text = (await client.get(base_url.rstrip("/") + "/metrics", headers=headers)).text
    after = [b for t, b in rss if t >= warmup_s]
    out = {"soak_seconds": seconds, "concurrency": concurrency, **summarize(results, wall),
           "rss_samples": rss, "final": {
               "kv_cache_usage_perc": _metric(text, "pagedllm:kv_cache_usage_perc"),
               "num_requests_running": _metric(text, "pagedllm:num_requests_running"),
               "num_requests_waiting": _metric(text, "pagedllm:num_requests_waiting")}}
    if after:
        out["rss_after_warmup_bytes"] = {"first": after[0], "last": after[-1], "max": max(after)}
        out["rss_growth_after_warmup"] = (after[-1] - after[0]) / after[0]
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def start_pagedllm(extra: str, port: int, model: str | None, log: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm", "serve", *([model] if model else []), "--port", str(port), *extra.split()]
    sink = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagedllm serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("pagedllm serve did not become healthy in 600 s")


def main(argv=None) -> int:
    if httpx is None:
        print("pagedllm bench serve needs httpx: pip install httpx", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="pagedllm bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="fixed concurrency level(s)")
    ap.add_argument("--request-rate", type=float, nargs="+", default=None, help="Poisson arrival rate(s), req/s")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[64],
                    help="requests per run: one number, or one per load level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)")
    ap.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 20000], help="token ids of random prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before each run")
    ap.add_argument("--offline", action="store_true",
                    help="with --start-server: first run pagedllm's offline engine (the server's engine arguments, "
                         "no server) on the same prompts at each --concurrency; the JSON gets each level's "
                         "offline tok/s and the server's fraction of it")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="split each fixed-concurrency load over this many client processes (the load generator's "
                         "Python must not be the bottleneck at high concurrency)")
    ap.add_argument("--label", default="pagedllm", help="name of the server under test, in the JSON")
    ap.add_argument("--start-server", default=None, metavar="ARGS",
                    help="start `pagedllm serve [--server-model] ARGS` on a free port and benchmark it")
    ap.add_argument("--server-model", default=None)
    ap.add_argument("--server-log", default=None, help="the started server's output to this file (default: discarded)")
    ap.add_argument("--out", default=None, help="output JSON path (default bench/results/<date>-<host>-serve.json)")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="a soak instead of the load levels: --concurrency[0] (default 16) clients back to back for "
                         "SECONDS; the server's resident memory over time (its pid: --start-server or --server-pid) "
                         "and, after the load, its KV-cache usage (issue 31: flat within 5%% after warm-up, 0 at the end)")
    ap.add_argument("--server-pid", type=int, default=None,
                    help="pid of the server (--base-url): its memory under --soak, its CPU time per run")
    ap.add_argument("--soak-sample", type=float, default=10.0, help="seconds between memory samples (--soak)")
    ap.add_argument("--soak-warmup", type=float, default=60.0, help="seconds of the soak before memory counts")
    args = ap.parse_args(argv)
    if args.soak is not None and args.concurrency is None:
        args.concurrency = [16]
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [1, 8, 32]

    offline = {}
    if args.offline:
        if args.start_server is None or not args.concurrency:
            ap.error("--offline needs --start-server (its engine arguments) and --concurrency")
        counts = args.num_prompts if len(args.num_prompts) == len(args.concurrency) else [args.num_prompts[0]] * len(
            args.concurrency)
        jobs = [(c, make_prompts(n, args.input_len, args.output_len, args.range_ratio, args.seed, *args.vocab_range))
                for c, n in zip(args.concurrency, counts)]
        for level in offline_levels(args.start_server, args.server_model, jobs):
            offline[level["concurrency"]] = level
            print(f"offline concurrency={level['concurrency']}: {level['output_throughput_tok_s']:.1f} out tok/s",
                  file=sys.stderr)
    proc = None
    if args.start_server is not None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        proc = start_pagedllm(args.start_server, port, args.server_model, args.server_log)
        print(f"pagedllm serve up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        args.base_url = f"http://127.0.0.1:{port}"
    if args.base_url is None:
        ap.error("give --base-url or --start-server")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers,
                                        timeout=30).json()["data"][0]["id"]
        runs = []
        if args.soak is not None:
            prompts = make_prompts(max(args.num_prompts[0], args.concurrency[0]), args.input_len, args.output_len,
                                   args.range_ratio, args.seed, *args.vocab_range)
            soak = asyncio.run(run_soak(args.base_url, model, prompts, args.concurrency[0], args.soak, args.api_key,
                                        proc.pid if proc is not None else args.server_pid, args.soak_sample,
                                        args.soak_warmup))
            runs.append(soak)
            print(f"{args.label} soak {args.soak:.0f} s x {args.concurrency[0]}: {soak['completed']} requests, "
                  f"errors {soak['errors']}, rss growth after warm-up {soak.get('rss_growth_after_warmup')}, "
                  f"final {soak['final']}", file=sys.stderr)
        loads = [] if args.soak is not None else (
            [("concurrency", c) for c in args.concurrency or []] + [("request_rate", r) for r in args.request_rate or []])
        counts = args.num_prompts if len(args.num_prompts) == len(loads) else [args.num_prompts[0]] * len(loads)
        for (kind, value), count in zip(loads, counts):
            # the same seed: every level (and every server) sees the same prompts, a prefix of them
            prompts = make_prompts(count, args.input_len, args.output_len, args.range_ratio, args.seed,
                                   *args.vocab_range)
            if args.warmup:
                warm = make_prompts(args.warmup, args.input_len, 8, 0.0, args.seed + 99, *args.vocab_range)
                run_load(args.base_url, model, warm, args.warmup, None, args.seed, args.api_key)
            pid = proc.pid if proc is not None else args.server_pid
            cpu0 = process_cpu(pid)
            summary = run_load(args.base_url, model, prompts, value if kind == "concurrency" else None,
                               value if kind == "request_rate" else None, args.seed, args.api_key,
                               args.client_processes)
            cpu1 = process_cpu(pid)
            if cpu1:  # the server's CPU seconds per second of the run (1.0 = one core busy), per process
                summary["server_cpu_utilization"] = {k: (cpu1[k] - cpu0.get(k, 0.0)) / summary["duration_s"]
                                                     for k in cpu1}
            run = {kind: value, "num_prompts": count, **summary}
            if kind == "concurrency" and value in offline:
                run["offline_output_throughput_tok_s"] = offline[value]["output_throughput_tok_s"]
                run["fraction_of_offline"] = summary["output_throughput_tok_s"] / run["offline_output_throughput_tok_s"]
                # one chunk per token: the bound is ITL p99 <= 1.5 x TPOT p50; prefill steps
                # between decode steps stretch ITL offline too, hence the offline engine's own ITL
                run["itl_p99_over_tpot_p50"] = summary["itl_ms"]["p99"] / summary["tpot_ms"]["p50"]
                run["offline_itl_ms"] = offline[value]["itl_ms"]
            runs.append(run)
            print(f"{args.label} {kind}={value}: {summary['output_throughput_tok_s']:.1f} out tok/s, "
                  f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, TPOT p50 {summary['tpot_ms']['p50']:.1f} ms, "
                  f"errors {summary['errors']}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    report = {
        "benchmark": "serve", "label": args.label, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": socket.gethostname(), "git_commit": git_commit(), "base_url": args.base_url, "model": model,
        "server_args": args.start_server, "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio, "seed": args.seed, "runs": runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    results = ROOT / "bench" / "results" if (ROOT / "bench" / "results").is_dir() else Path.cwd()
    out = Path(args.out) if args.out else results / (
        f"{datetime.date.today().isoformat()}-{socket.gethostname()}-serve"
        f"{'' if args.label == 'pagedllm' else '-' + args.label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
